#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use serde_json::json;

use super::*;

/// A pod as the API server returns it; `f` edits the JSON first.
fn pod(name: &str, f: impl FnOnce(&mut serde_json::Value)) -> Pod {
    let mut v = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": {"app": "m"}},
        "spec": {"nodeName": "node-a", "containers": [{"name": "engine"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"}
            ]
        }
    });
    f(&mut v);
    serde_json::from_value(v).unwrap()
}

fn pool(ports: &[i32]) -> PoolView {
    PoolView {
        selector: [("app".to_owned(), "m".to_owned())].into(),
        target_ports: ports.to_vec(),
    }
}

#[test]
fn a_ready_pod_is_ready_on_its_node() {
    let v = pod_view(&pod("p", |_| {})).unwrap();
    assert!(v.ready);
    assert_eq!(v.ip, "10.0.0.7".parse::<IpAddr>().unwrap());
    assert_eq!(v.node.as_deref(), Some("node-a"));
    assert_eq!(v.role, Role::Both);
    assert_eq!((v.events_port, v.replay_port), (None, None));
}

#[test]
fn readiness_needs_the_ready_condition_and_no_deletion() {
    let not_ready = pod("p", |v| {
        v["status"]["conditions"][1]["status"] = json!("False")
    });
    assert!(!pod_view(&not_ready).unwrap().ready);
    let no_conditions = pod("p", |v| v["status"]["conditions"] = json!([]));
    assert!(!pod_view(&no_conditions).unwrap().ready);
    let unknown = pod("p", |v| {
        v["status"]["conditions"][1]["status"] = json!("Unknown")
    });
    assert!(!pod_view(&unknown).unwrap().ready);
    let deleting = pod("p", |v| {
        v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    });
    assert!(
        !pod_view(&deleting).unwrap().ready,
        "a terminating pod takes no new requests"
    );
}

#[test]
fn pods_without_ip_or_finished_are_skipped() {
    assert_eq!(
        pod_view(&pod("p", |v| v["status"]["podIP"] = json!(null))),
        None
    );
    assert_eq!(
        pod_view(&pod("p", |v| v["status"]["podIP"] = json!("not-an-ip"))),
        None
    );
    assert_eq!(pod_view(&pod("p", |v| v["status"] = json!(null))), None);
    for phase in ["Succeeded", "Failed"] {
        assert_eq!(
            pod_view(&pod("p", |v| v["status"]["phase"] = json!(phase))),
            None
        );
    }
    let pending = pod("p", |v| v["status"]["phase"] = json!("Pending"));
    assert!(
        pod_view(&pending).is_some(),
        "a pending pod with an IP is listed, not ready"
    );
    let v6 = pod_view(&pod("p", |v| v["status"]["podIP"] = json!("fd00::7"))).unwrap();
    let eps = endpoints(&pool(&[8000]), [&v6]);
    assert_eq!(eps[0].address.to_string(), "[fd00::7]:8000");
}

#[test]
fn roles_from_kvgate_then_llm_d_labels() {
    let with = |pairs: &[(&str, &str)]| {
        let mut l: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in pairs {
            l.insert((*k).to_owned(), (*v).to_owned());
        }
        role_of(&l)
    };
    assert_eq!(with(&[]), Some(Role::Both));
    assert_eq!(with(&[(ROLE_LABEL, "prefill")]), Some(Role::Prefill));
    assert_eq!(with(&[(ROLE_LABEL, "decode")]), Some(Role::Decode));
    assert_eq!(with(&[(ROLE_LABEL, "both")]), Some(Role::Both));
    assert_eq!(
        with(&[(ROLE_LABEL, "decode"), (LLM_D_ROLE_LABEL, "prefill")]),
        Some(Role::Decode),
        "kvgate's label wins"
    );
    assert_eq!(with(&[(LLM_D_ROLE_LABEL, "prefill")]), Some(Role::Prefill));
    assert_eq!(
        with(&[(LLM_D_ROLE_LABEL, "prefill-decode")]),
        Some(Role::Both)
    );
    assert_eq!(
        with(&[(LLM_D_ROLE_LABEL, "encode-prefill")]),
        Some(Role::Prefill)
    );
    assert_eq!(
        with(&[(LLM_D_ROLE_LABEL, "encode-decode")]),
        Some(Role::Decode)
    );
    assert_eq!(
        with(&[(LLM_D_ROLE_LABEL, "encode-prefill-decode")]),
        Some(Role::Both)
    );
    assert_eq!(
        with(&[(LLM_D_ROLE_LABEL, "encode")]),
        None,
        "encoders serve no text"
    );
    assert_eq!(with(&[(ROLE_LABEL, "oddity")]), Some(Role::Both));
    let prefill = pod("p", |v| {
        v["metadata"]["labels"][ROLE_LABEL] = json!("prefill")
    });
    assert_eq!(pod_view(&prefill).unwrap().role, Role::Prefill);
    let encoder = pod("p", |v| {
        v["metadata"]["labels"][LLM_D_ROLE_LABEL] = json!("encode")
    });
    assert_eq!(pod_view(&encoder), None);
}

#[test]
fn each_port_is_a_rank() {
    let a = pod_view(&pod("a", |v| {
        v["metadata"]["annotations"] = json!({
            EVENTS_PORT_ANNOTATION: "5557",
            REPLAY_PORT_ANNOTATION: " 5600 "
        });
    }))
    .unwrap();
    let eps = endpoints(&pool(&[8000, 8001, 8002]), [&a]);
    assert_eq!(eps.len(), 3);
    for (rank, e) in eps.iter().enumerate() {
        let port = 8000 + rank as u16;
        assert_eq!(e.key, ("a".to_owned(), port));
        assert_eq!(e.address, SocketAddr::new(a.ip, port));
        assert_eq!(e.node.as_deref(), Some("node-a"));
        assert_eq!(
            e.events.as_deref(),
            Some(format!("tcp://10.0.0.7:{}", 5557 + rank).as_str())
        );
        assert_eq!(
            e.replay.as_deref(),
            Some(format!("tcp://10.0.0.7:{}", 5600 + rank).as_str())
        );
        assert!(e.ready);
        assert!(e.models.is_empty());
    }
}

#[test]
fn bad_ports_and_annotations_are_skipped() {
    assert_eq!(
        target_ports(&pool(&[0, 8000, 70000, -1, 8000, 8001])),
        vec![(1, 8000), (5, 8001)]
    );
    assert_eq!(
        target_ports(&pool(&[1, 2, 3, 4, 5, 6, 7, 8, 9])).len(),
        MAX_TARGET_PORTS
    );
    assert!(target_ports(&pool(&[])).is_empty());
    let a = pod_view(&pod("a", |v| {
        v["metadata"]["annotations"] =
            json!({EVENTS_PORT_ANNOTATION: "nope", REPLAY_PORT_ANNOTATION: "0"});
    }))
    .unwrap();
    assert_eq!((a.events_port, a.replay_port), (None, None));
    let top = pod_view(&pod("t", |v| {
        v["metadata"]["annotations"] = json!({EVENTS_PORT_ANNOTATION: "65535"});
    }))
    .unwrap();
    let eps = endpoints(&pool(&[8000, 8001]), [&top]);
    assert_eq!(eps[0].events.as_deref(), Some("tcp://10.0.0.7:65535"));
    assert_eq!(eps[1].events, None, "rank 1 would overflow the port");
}

#[test]
fn only_selected_pods_in_name_order() {
    let b = pod_view(&pod("b", |_| {})).unwrap();
    let a = pod_view(&pod("a", |v| v["status"]["podIP"] = json!("10.0.0.8"))).unwrap();
    let other = pod_view(&pod("c", |v| {
        v["metadata"]["labels"] = json!({"app": "other"})
    }))
    .unwrap();
    let unlabelled = pod_view(&pod("d", |v| v["metadata"]["labels"] = json!(null))).unwrap();
    let eps = endpoints(&pool(&[8000]), [&b, &other, &a, &unlabelled]);
    let names: Vec<&str> = eps.iter().map(|e| e.key.0.as_str()).collect();
    assert_eq!(names, vec!["a", "b"]);
    assert!(
        endpoints(&PoolView::default(), [&a, &b]).is_empty(),
        "an empty selector selects nothing"
    );
}
