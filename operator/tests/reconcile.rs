//! The controller against a real API server (kapi): it scales through `/scale`, writes status,
//! conditions and Events, reports a manual edit instead of fighting it, holds when the metrics
//! are missing or bad, says so when the target is missing, and retries a conflicting write.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::time::Duration;

use api::autoscaler::ScaleTargetRef;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, PostParams};
use kvgate_operator::scale::{ScaleError, Scaler};
use serde_json::json;
use support::*;

/// First scrape (rates need two), then the decision: two intervals and some slack.
const DECIDED: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scales_through_scale_and_writes_status_conditions_and_events() {
    let (_kapi, client) = cluster().await;
    let epp = FakeEpp::start(Some(SLOW)).await;
    pool(&client, epp.port).await;
    deployment(&client, "model", 2).await;
    let _controller = deployment_controller(&client, &["model"]);
    autoscaler(&client, "qwen", load_mode_spec(1, 4)).await;
    let op = Operator::start(&client, "op-a");

    until(DECIDED, "scale-up to 3", || async {
        (replicas(&client, "model").await == 3).then_some(())
    })
    .await;
    let pa = until(DECIDED, "status after the scale", || async {
        let pa = get(&client, "qwen").await;
        let both = pa.status.as_ref()?.roles.both.clone()?;
        (both.desired_replicas == 3).then_some(pa)
    })
    .await;
    let st = pa.status.clone().unwrap();
    let observed = st.observed.clone().expect("observed load");
    assert!((observed.rps - 20.0).abs() < 4.0, "rps {}", observed.rps);
    assert!(
        (observed.isl_tokens - 1000.0).abs() < 1.0,
        "isl {}",
        observed.isl_tokens
    );
    assert!(
        (observed.osl_tokens - 200.0).abs() < 1.0,
        "osl {}",
        observed.osl_tokens
    );
    // p90 of observations all in the (1 s, 2 s] bucket, interpolated as Prometheus does.
    let ttft = observed.ttft_ms.expect("ttft at the percentile");
    assert!((1000.0..=2000.0).contains(&ttft), "ttft {ttft}");
    assert!(observed.itl_ms.is_some());
    assert!(st.last_decision.as_deref().is_some_and(|d| !d.is_empty()));
    assert!(st.roles.both.as_ref().unwrap().last_scale_time.is_some());
    assert_eq!(st.gpus, Some(3));
    assert_eq!(st.observed_generation, pa.metadata.generation);
    assert_eq!(condition(&pa, "Ready").unwrap().0, "True");
    assert_eq!(condition(&pa, "MetricsAvailable").unwrap().0, "True");
    assert_eq!(condition(&pa, "BudgetLimited").unwrap().0, "False");
    let scaling = condition(&pa, "Scaling").unwrap();
    assert_eq!((scaling.0.as_str(), scaling.1.as_str()), ("True", "Scaled"));

    let events = events(&client, "qwen").await;
    assert!(
        events.iter().any(|(t, r, n, i)| t == "Normal"
            && r == "Scaled"
            && n.contains("Deployment model: 2 → 3")
            && i == "op-a"),
        "{events:?}"
    );
    let page = op.metrics.render();
    assert!(
        page.contains("kvgate_operator_scale_operations_total{role=\"both\",direction=\"up\"} 1"),
        "{page}"
    );
    assert!(page.contains("kvgate_operator_desired_replicas{namespace=\"llm\",autoscaler=\"qwen\",role=\"both\"} 3"), "{page}");

    // Within the SLO at the new size, the autoscaler settles: Scaling goes False.
    epp.set(Some(Load {
        ttft_s: 0.3,
        itl_s: 0.02,
        ..SLOW
    }));
    until(
        Duration::from_secs(60),
        "Scaling False once stable",
        || async {
            let pa = get(&client, "qwen").await;
            let c = condition(&pa, "Scaling")?;
            (c.0 == "False").then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_edit_is_reported_not_fought_silently() {
    let (_kapi, client) = cluster().await;
    let epp = FakeEpp::start(Some(SLOW)).await;
    pool(&client, epp.port).await;
    deployment(&client, "model", 2).await;
    let _controller = deployment_controller(&client, &["model"]);
    autoscaler(&client, "qwen", load_mode_spec(1, 4)).await;
    let op = Operator::start(&client, "op-a");
    until(DECIDED, "scale-up to 3", || async {
        (replicas(&client, "model").await == 3).then_some(())
    })
    .await;

    // Metrics gone (the planner holds), then someone scales the target by hand.
    epp.set(None);
    scale_by_hand(&client, "model", 2).await;
    let note = until(DECIDED, "a ScaledOutsideOperator event", || async {
        events(&client, "qwen")
            .await
            .into_iter()
            .find(|(t, r, _, _)| t == "Warning" && r == "ScaledOutsideOperator")
            .map(|(_, _, n, _)| n)
    })
    .await;
    assert!(
        note.contains("2 replicas, set outside the operator (it last set 3)"),
        "{note}"
    );
    assert!(
        op.metrics
            .render()
            .contains("kvgate_operator_manual_changes_total 1")
    );
    // Held for two more intervals: the operator plans from the edit, it does not undo it.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(replicas(&client, "model").await, 2);
    let pa = get(&client, "qwen").await;
    assert_eq!(pa.status.unwrap().roles.both.unwrap().current_replicas, 2);

    // Latency over the SLO again: the next decision scales from 2, and says so.
    epp.set(Some(SLOW));
    // (The first 2 → 3 was the operator's own; a second one follows the edit.)
    until(DECIDED, "a scale from the edited count", || async {
        let n = events(&client, "qwen")
            .await
            .into_iter()
            .filter(|(_, r, n, _)| r == "Scaled" && n.contains("Deployment model: 2 → 3"))
            .count();
        (n == 2).then_some(())
    })
    .await;
    // The one warning, not one per interval.
    let warnings = events(&client, "qwen")
        .await
        .into_iter()
        .filter(|(_, r, _, _)| r == "ScaledOutsideOperator")
        .count();
    assert_eq!(warnings, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_bad_metrics_hold_the_replicas_and_say_why() {
    let (_kapi, client) = cluster().await;
    let epp = FakeEpp::start(None).await;
    pool(&client, epp.port).await;
    deployment(&client, "model", 2).await;
    let _controller = deployment_controller(&client, &["model"]);
    autoscaler(&client, "qwen", load_mode_spec(1, 4)).await;
    let op = Operator::start(&client, "op-a");

    // The EPP answers 503.
    let (_, reason, message) = until(DECIDED, "MetricsAvailable False", || async {
        let pa = get(&client, "qwen").await;
        condition(&pa, "MetricsAvailable").filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(reason, "EppUnreachable", "{message}");
    assert!(
        message.contains("503") && message.contains("holds"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(
        replicas(&client, "model").await,
        2,
        "neither min (1) nor max (4)"
    );
    let pa = get(&client, "qwen").await;
    let st = pa.status.clone().unwrap();
    assert_eq!(st.roles.both.unwrap().desired_replicas, 2);
    assert!(st.observed.is_none());
    assert!(
        op.metrics
            .render()
            .contains("kvgate_operator_metrics_failures_total{reason=\"EppUnreachable\"}"),
        "{}",
        op.metrics.render()
    );

    // The EPP Service selects no pod: named as such.
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), NS)
        .delete("pool-epp-0", &Default::default())
        .await
        .unwrap();
    let (_, _, message) = until(DECIDED, "EppServiceMissing", || async {
        let pa = get(&client, "qwen").await;
        condition(&pa, "MetricsAvailable").filter(|c| c.1 == "EppServiceMissing")
    })
    .await;
    assert!(
        message.contains("pool-epp") && message.contains("selects no pod"),
        "{message}"
    );
    assert_eq!(replicas(&client, "model").await, 2);
    // Ready stays True: the operator works, it only has nothing to plan from.
    assert_eq!(
        condition(&get(&client, "qwen").await, "Ready").unwrap().0,
        "True"
    );

    // Deleted, the autoscaler's series go too.
    assert!(op.metrics.render().contains("autoscaler=\"qwen\""));
    Api::<api::autoscaler::PoolAutoscaler>::namespaced(client.clone(), NS)
        .delete("qwen", &Default::default())
        .await
        .unwrap();
    until(
        Duration::from_secs(20),
        "the deleted autoscaler's series gone",
        || async { (!op.metrics.render().contains("autoscaler=\"qwen\"")).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_target_is_reported_and_picked_up_once_created() {
    let (_kapi, client) = cluster().await;
    let epp = FakeEpp::start(Some(SLOW)).await;
    pool(&client, epp.port).await;
    autoscaler(&client, "qwen", load_mode_spec(1, 4)).await;
    let _op = Operator::start(&client, "op-a");

    let (_, reason, message) = until(DECIDED, "Ready False", || async {
        let pa = get(&client, "qwen").await;
        condition(&pa, "Ready").filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(reason, "TargetMissing");
    assert_eq!(message, "Deployment model not found");
    until(DECIDED, "a TargetMissing event", || async {
        events(&client, "qwen")
            .await
            .into_iter()
            .find(|(t, r, _, _)| t == "Warning" && r == "TargetMissing")
    })
    .await;

    deployment(&client, "model", 1).await;
    let _controller = deployment_controller(&client, &["model"]);
    until(
        Duration::from_secs(40),
        "Ready True once the target exists",
        || async {
            let pa = get(&client, "qwen").await;
            condition(&pa, "Ready").filter(|c| c.0 == "True")
        },
    )
    .await;
    until(DECIDED, "the target scaled", || async {
        (replicas(&client, "model").await == 2).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_without_scale_is_refused_by_name() {
    let (_kapi, client) = cluster().await;
    let scaler = Scaler::default();
    let target = ScaleTargetRef {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "x".into(),
    };
    let err = scaler.get(&client, NS, &target).await.unwrap_err();
    assert!(matches!(err, ScaleError::NoScale { .. }), "{err}");
    assert_eq!(err.reason(), "TargetKindNotScalable");
    let target = ScaleTargetRef {
        api_version: "apps/v1".into(),
        kind: "Nonesuch".into(),
        name: "x".into(),
    };
    let err = scaler.get(&client, NS, &target).await.unwrap_err();
    assert!(matches!(err, ScaleError::Kind { .. }), "{err}");
    let target = ScaleTargetRef {
        api_version: "a/b/c".into(),
        kind: "Deployment".into(),
        name: "x".into(),
    };
    assert!(matches!(
        scaler.get(&client, NS, &target).await.unwrap_err(),
        ScaleError::BadApiVersion(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_scale_write_is_read_again_and_retried() {
    let (_kapi, client) = cluster().await;
    deployment(&client, "model", 2).await;
    let scaler = Scaler::default();
    let target = ScaleTargetRef {
        api_version: "apps/v1".into(),
        kind: "Deployment".into(),
        name: "model".into(),
    };
    let api = scaler.api_for(&client, NS, &target).await.unwrap();
    let stale = api.get_scale("model").await.unwrap();
    // Someone else writes between the operator's read and its write.
    scale_by_hand(&client, "model", 5).await;
    let (before, conflicts) = scaler.write_from(&api, &target, stale, 3).await.unwrap();
    assert_eq!(conflicts, 1, "the stale write met a conflict");
    assert_eq!(before, 5, "the retry read the other writer's value");
    assert_eq!(replicas(&client, "model").await, 3);

    // Through the public path too, and the Deployment's own spec says so.
    assert_eq!(scaler.set(&client, NS, &target, 4).await.unwrap(), 3);
    let d = Api::<Deployment>::namespaced(client.clone(), NS)
        .get("model")
        .await
        .unwrap();
    assert_eq!(d.spec.replicas, Some(4));
    // A missing target is named.
    let missing = ScaleTargetRef {
        name: "gone".into(),
        ..target
    };
    let err = scaler.set(&client, NS, &missing, 1).await.unwrap_err();
    assert_eq!(err.reason(), "TargetMissing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crd_refuses_what_the_planner_could_not_honour() {
    let (_kapi, client) = cluster().await;
    let api = Api::<api::autoscaler::PoolAutoscaler>::namespaced(client.clone(), NS);
    let refused = |spec: serde_json::Value| {
        let api = api.clone();
        async move {
            let pa: api::autoscaler::PoolAutoscaler = serde_json::from_value(json!({
                "apiVersion": "kvgate.io/v1alpha1", "kind": "PoolAutoscaler",
                "metadata": {"name": "bad", "namespace": NS}, "spec": spec}))
            .unwrap();
            match api.create(&PostParams::default(), &pa).await {
                Err(kube::Error::Api(s)) => s.message,
                other => panic!("accepted: {other:?}"),
            }
        }
    };
    let mut spec = load_mode_spec(3, 2);
    assert!(
        refused(spec.clone())
            .await
            .contains("minReplicas must not exceed maxReplicas")
    );
    spec = load_mode_spec(3, 4);
    spec["gpuBudget"] = json!(2);
    assert!(refused(spec.clone()).await.contains("gpuBudget must cover"));
    spec = load_mode_spec(1, 4);
    spec["planner"]["mode"] = json!("Throughput");
    assert!(refused(spec.clone()).await.contains("need a profile"));
    spec = load_mode_spec(1, 4);
    spec["roles"]["prefill"] = spec["roles"]["both"].clone();
    assert!(refused(spec.clone()).await.contains("roles.both alone"));
    spec = load_mode_spec(1, 4);
    spec["planner"]["intervalSeconds"] = json!(1);
    assert!(refused(spec.clone()).await.contains("intervalSeconds"));
    spec = load_mode_spec(1, 4);
    spec["metrics"] = json!({"source": "Prometheus"});
    assert!(
        refused(spec)
            .await
            .contains("metrics.prometheus is required")
    );
}
