//! The harness against the real binaries: start, restart on the same port, RBAC tokens, and an
//! etcd restore that takes resource versions back in time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kapi::pods::{self, PodInfo};
use kapi::{Authorization, Kapi, KapiOptions, Token};
use kube::api::Api;

fn pod(name: &str) -> PodInfo {
    PodInfo {
        name: name.to_owned(),
        labels: BTreeMap::from([("app".to_owned(), "m".to_owned())]),
        node: "node-a".to_owned(),
        ip: "127.0.0.2".parse().unwrap(),
        ready: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_keep_the_port_and_a_restore_goes_back_in_time() {
    let mut kapi = Kapi::start(KapiOptions::default()).await.unwrap();
    let client = kapi.client().await.unwrap();
    pods::ensure_namespace(&client, "t").await.unwrap();
    let before = pods::create(&client, "t", &pod("a")).await.unwrap();
    assert_eq!(
        before.status.as_ref().unwrap().pod_ip.as_deref(),
        Some("127.0.0.2")
    );

    let backup = kapi.backup_etcd().await.unwrap();
    pods::create(&client, "t", &pod("b")).await.unwrap();
    kapi.stop_apiserver();
    let api: Api<Pod> = Api::namespaced(client.clone(), "t");
    assert!(api.get("a").await.is_err(), "the server is down");
    kapi.start_apiserver().await.unwrap();
    assert_eq!(api.list(&Default::default()).await.unwrap().items.len(), 2);

    kapi.restore_etcd(&backup).await.unwrap();
    let names: Vec<String> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(
        names,
        vec!["a".to_owned()],
        "b was created after the backup"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_mode_refuses_a_token_without_a_role() {
    let options = KapiOptions {
        authorization: Authorization::Rbac,
        tokens: vec![Token::service_account("sa-token", "t", "reader")],
        ..KapiOptions::default()
    };
    let kapi = Kapi::start(options).await.unwrap();
    let admin = kapi.client().await.unwrap();
    pods::ensure_namespace(&admin, "t").await.unwrap();
    let path = kapi.kubeconfig_for("reader", "sa-token").unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let reader = kube::Client::try_from(config).unwrap();
    let err = Api::<Pod>::namespaced(reader, "t")
        .list(&Default::default())
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("expected 403, got {other}"),
    }
}
