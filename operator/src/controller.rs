//! The PoolAutoscaler controller: each autoscaler's allow-list kept at every pod change, and,
//! once per planner interval, its targets' replicas read through `/scale`, its pool's load and
//! latency read, the planner asked, the targets scaled, and status and Events written.
//!
//! A target scaled by someone else is reported (a Warning event, a counter) and its new count
//! becomes the planner's starting point: the operator does not silently fight it, and what it
//! does next is in the next decision's event. Missing or bad metrics never scale: the planner
//! holds, and status says why.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::autoscaler::{
    MetricsSource, ObservedLoad, PoolAutoscaler, PoolAutoscalerStatus, RoleStatus, RoleStatuses,
};
use api::pool::{PoolView, v1, v1alpha2};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource as _, ResourceExt as _};
use planner::{Decision, Observation, Planner, Role};
use tokio::time::Instant;

use crate::allowlist;
use crate::events::{Events, Kind as EventType};
use crate::metrics::Metrics;
use crate::observe::{Observed, Snapshot};
use crate::plan;
use crate::scale::{Replicas, Scaler};
use crate::source::{self, Http, SourceError};

/// How soon a failed reconcile is tried again.
const RETRY: Duration = Duration::from_secs(10);
/// How often deleted autoscalers are looked for.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

/// Why a reconcile failed (it is retried after 10 s).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The autoscaler has no namespace.
    #[error("PoolAutoscaler without a namespace")]
    NoNamespace,
    /// The status could not be written.
    #[error("status of {name}: {source}")]
    Status {
        /// The autoscaler.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

/// What reconciles share.
pub struct Context {
    /// The API client.
    pub client: kube::Client,
    /// `/scale` reads and writes.
    pub scaler: Scaler,
    /// Scrapes and Prometheus queries.
    pub http: Http,
    /// Kubernetes Events.
    pub events: Events,
    /// The operator's metrics.
    pub metrics: Arc<Metrics>,
    states: Mutex<HashMap<(String, String), AutoscalerState>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl Context {
    /// Forgets every planner's state (a new term of leadership starts from the cluster's
    /// state, not from what this replica remembered from an earlier term).
    pub fn reset(&self) {
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// How many autoscalers have state.
    pub fn tracked(&self) -> usize {
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Forgets the autoscalers not in `live` (deleted ones): their planner state and their
    /// per-autoscaler metric series.
    pub fn retain(&self, live: &[(String, String)]) {
        let mut states = self
            .states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gone: Vec<(String, String)> = states
            .keys()
            .filter(|k| !live.contains(k))
            .cloned()
            .collect();
        for (namespace, name) in gone {
            states.remove(&(namespace.clone(), name.clone()));
            self.metrics.forget(&namespace, &name);
            tracing::info!(%namespace, autoscaler = %name, "autoscaler gone: its state and series forgotten");
        }
    }

    /// A context; the planners' states start empty.
    pub fn new(client: kube::Client, http: Http, events: Events, metrics: Arc<Metrics>) -> Self {
        Self {
            client,
            scaler: Scaler::default(),
            http,
            events,
            metrics,
            states: Mutex::new(HashMap::new()),
        }
    }
}

/// One autoscaler's memory between reconciles.
struct AutoscalerState {
    /// The spec generation and profile version the planner was built for.
    built_for: (i64, Option<String>),
    planner: Planner,
    previous: Option<Snapshot>,
    next_due: Instant,
    /// What the operator last wrote to each target.
    last_set: BTreeMap<Role, i32>,
}

/// The pool as the operator needs it.
struct PoolInfo {
    view: PoolView,
    epp_service: Option<String>,
}

fn now_s() -> f64 {
    Timestamp::now().as_millisecond() as f64 / 1000.0
}

fn now_rfc3339() -> String {
    Timestamp::now().to_string()
}

async fn read_pool(
    client: &kube::Client,
    namespace: &str,
    pa: &PoolAutoscaler,
) -> Result<Option<PoolInfo>, kube::Error> {
    let name = &pa.spec.pool_ref.name;
    let alpha = pa.spec.pool_ref.group.as_deref() == Some(api::pool::GROUP_V1ALPHA2);
    if alpha {
        return match Api::<v1alpha2::InferencePool>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
        {
            Some(p) => Ok(Some(PoolInfo {
                view: PoolView::from(&p.spec),
                epp_service: p.spec.extension_ref.map(|e| e.name),
            })),
            None => Ok(None),
        };
    }
    Ok(
        Api::<v1::InferencePool>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
            .map(|p| PoolInfo {
                view: PoolView::from(&p.spec),
                epp_service: p.spec.endpoint_picker_ref.map(|e| e.name),
            }),
    )
}

async fn read_profile(
    client: &kube::Client,
    namespace: &str,
    pa: &PoolAutoscaler,
) -> Result<Option<(planner::Profile, String)>, String> {
    let Some(r) = &pa.spec.profile else {
        return Ok(None);
    };
    let cm = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get_opt(&r.config_map_name)
        .await
        .map_err(|e| format!("ConfigMap {}: {e}", r.config_map_name))?
        .ok_or_else(|| format!("ConfigMap {} not found", r.config_map_name))?;
    let version = cm.metadata.resource_version.clone().unwrap_or_default();
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .ok_or_else(|| format!("ConfigMap {} has no key {}", r.config_map_name, r.key))?;
    let profile: planner::Profile = serde_yaml_ng::from_str(text)
        .map_err(|e| format!("ConfigMap {} key {}: {e}", r.config_map_name, r.key))?;
    Ok(Some((profile, version)))
}

/// Reconciles one autoscaler.
pub async fn reconcile(
    pa: Arc<PoolAutoscaler>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let namespace = pa.namespace().ok_or(ReconcileError::NoNamespace)?;
    let name = pa.name_any();
    let interval =
        Duration::from_secs(u64::try_from(pa.spec.planner.interval_seconds).unwrap_or(30));
    let mut report = Report::new(&pa);

    let pool = match read_pool(&ctx.client, &namespace, &pa).await {
        Ok(Some(p)) => p,
        Ok(None) => {
            report.not_ready(
                "PoolMissing",
                format!("InferencePool {} not found", pa.spec.pool_ref.name),
            );
            report.write(&ctx, &pa).await?;
            return Ok(Action::requeue(interval));
        }
        Err(e) => {
            report.not_ready("PoolUnreadable", e.to_string());
            report.write(&ctx, &pa).await?;
            return Ok(Action::requeue(RETRY));
        }
    };

    if let Some(al) = &pa.spec.prefiller_allow_list {
        match allowlist::sync(
            &ctx.client,
            &namespace,
            &al.config_map_name,
            &pool.view.selector,
            &pool.view.target_ports,
        )
        .await
        {
            Ok((prefillers, true)) => {
                ctx.metrics.allow_list_updated();
                tracing::info!(autoscaler = %name, config_map = %al.config_map_name, prefillers, "prefill allow-list updated");
            }
            Ok((_, false)) => {}
            Err(e) => {
                tracing::warn!(autoscaler = %name, error = %e, "prefill allow-list not updated")
            }
        }
    }

    let profile = match read_profile(&ctx.client, &namespace, &pa).await {
        Ok(p) => p,
        Err(why) => {
            report.not_ready("ProfileUnreadable", why);
            report.write(&ctx, &pa).await?;
            return Ok(Action::requeue(interval));
        }
    };
    let key = (namespace.clone(), name.clone());
    let generation = pa.metadata.generation.unwrap_or(0);
    let built_for = (generation, profile.as_ref().map(|(_, v)| v.clone()));
    let built: Result<Option<Instant>, String> = {
        let mut states = ctx
            .states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fresh = states.get(&key).is_none_or(|s| s.built_for != built_for);
        let mut result = Ok(());
        if fresh {
            let config = plan::config(&pa.spec, profile.map(|(p, _)| p));
            match Planner::new(config) {
                Ok(planner) => {
                    let last_set = previous_desired(&pa);
                    let previous = states.get(&key).and_then(|s| s.previous.clone());
                    states.insert(
                        key.clone(),
                        AutoscalerState {
                            built_for,
                            planner,
                            previous,
                            next_due: Instant::now(),
                            last_set,
                        },
                    );
                }
                Err(e) => result = Err(e.to_string()),
            }
        }
        result.map(|()| states.get(&key).map(|s| s.next_due))
    };
    let due = match built {
        Ok(due) => due,
        Err(why) => {
            report.not_ready("InvalidConfiguration", why);
            report.write(&ctx, &pa).await?;
            return Ok(Action::requeue(interval));
        }
    };
    let now = Instant::now();
    if let Some(due) = due
        && due > now
    {
        return Ok(Action::requeue(due - now));
    }

    // The targets.
    let mut current: BTreeMap<Role, Replicas> = BTreeMap::new();
    for (role, target) in plan::roles(&pa.spec) {
        match ctx
            .scaler
            .get(&ctx.client, &namespace, &target.scale_target_ref)
            .await
        {
            Ok(r) => {
                current.insert(role, r);
            }
            Err(e) => {
                ctx.metrics.scale_error(e.reason());
                report.not_ready(e.reason(), e.to_string());
                report
                    .event(&ctx, &pa, EventType::Warning, e.reason(), &e.to_string())
                    .await;
                set_next_due(&ctx, &key, Instant::now() + interval);
                report.write(&ctx, &pa).await?;
                return Ok(Action::requeue(interval));
            }
        }
    }

    // Changes made by someone else since the operator last wrote.
    let last_set = ctx
        .states
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
        .map(|s| s.last_set.clone())
        .unwrap_or_default();
    for (role, r) in &current {
        if let Some(set) = last_set.get(role)
            && *set != r.spec
        {
            ctx.metrics.manual_change();
            let msg = format!(
                "{role}: {} replicas, set outside the operator (it last set {set}); planning from {}",
                r.spec, r.spec
            );
            tracing::warn!(autoscaler = %name, %msg, "target scaled by someone else");
            report
                .event(&ctx, &pa, EventType::Warning, "ScaledOutsideOperator", &msg)
                .await;
        }
    }

    // Load and latency.
    let observed = observe(&ctx, &pa, &namespace, &pool, &key).await;
    let metrics_ok = match &observed {
        Ok(_) => None,
        Err(e) => {
            ctx.metrics.metrics_failure(e.reason());
            Some((e.reason(), e.to_string()))
        }
    };

    // The decision.
    let observation = Observation {
        at_s: now_s(),
        metrics: observed.as_ref().ok().map(plan::metrics),
        replicas: current
            .iter()
            .map(|(r, n)| (*r, u32::try_from(n.spec).unwrap_or(0)))
            .collect(),
        ready: current
            .iter()
            .map(|(r, n)| (*r, u32::try_from(n.status).unwrap_or(0)))
            .collect(),
    };
    let decision: Decision = {
        let mut states = ctx
            .states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match states.get_mut(&key) {
            Some(s) => {
                s.next_due = now + interval;
                s.planner.plan(&observation)
            }
            None => return Ok(Action::requeue(RETRY)),
        }
    };
    ctx.metrics.decision(decision.reason.metric_label());

    // Scaling.
    let mut scaled_now = BTreeMap::new();
    for (role, target) in plan::roles(&pa.spec) {
        let Some(want) = decision
            .desired
            .get(&role)
            .map(|n| i32::try_from(*n).unwrap_or(i32::MAX))
        else {
            continue;
        };
        let have = current.get(&role).map_or(0, |r| r.spec);
        ctx.metrics
            .set_desired(&namespace, &name, role.as_str(), i64::from(want));
        if want == have {
            continue;
        }
        match ctx
            .scaler
            .set(&ctx.client, &namespace, &target.scale_target_ref, want)
            .await
        {
            Ok(before) => {
                let direction = if want > before { "up" } else { "down" };
                ctx.metrics.scaled(role.as_str(), direction);
                let msg = format!(
                    "{role} {} {}: {before} → {want} replicas ({})",
                    target.scale_target_ref.kind, target.scale_target_ref.name, decision.reason
                );
                tracing::info!(autoscaler = %name, %msg, "scaled");
                report
                    .event(&ctx, &pa, EventType::Normal, "Scaled", &msg)
                    .await;
                scaled_now.insert(role, now_rfc3339());
                if let Some(s) = ctx
                    .states
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get_mut(&key)
                {
                    s.last_set.insert(role, want);
                }
            }
            Err(e) => {
                ctx.metrics.scale_error(e.reason());
                report
                    .event(&ctx, &pa, EventType::Warning, "ScaleFailed", &e.to_string())
                    .await;
                report.not_ready(e.reason(), e.to_string());
            }
        }
    }
    // Targets left as they were: what they have is what the operator stands by.
    if let Some(s) = ctx
        .states
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_mut(&key)
    {
        for (role, r) in &current {
            if !scaled_now.contains_key(role)
                && decision.desired.get(role).copied() == u32::try_from(r.spec).ok()
            {
                s.last_set.insert(*role, r.spec);
            }
        }
    }

    report.decided(
        &pa,
        &current,
        &decision,
        observed.ok(),
        metrics_ok,
        &scaled_now,
    );
    report.write(&ctx, &pa).await?;
    Ok(Action::requeue(interval))
}

fn set_next_due(ctx: &Context, key: &(String, String), at: Instant) {
    if let Some(s) = ctx
        .states
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_mut(key)
    {
        s.next_due = at;
    }
}

/// What the status said the operator wanted last: a new leader does not mistake its
/// predecessor's writes for someone else's.
fn previous_desired(pa: &PoolAutoscaler) -> BTreeMap<Role, i32> {
    let Some(st) = &pa.status else {
        return BTreeMap::new();
    };
    [
        (Role::Prefill, st.roles.prefill.as_ref()),
        (Role::Decode, st.roles.decode.as_ref()),
        (Role::Both, st.roles.both.as_ref()),
    ]
    .into_iter()
    .filter_map(|(r, s)| s.map(|s| (r, s.desired_replicas)))
    .collect()
}

async fn observe(
    ctx: &Context,
    pa: &PoolAutoscaler,
    namespace: &str,
    pool: &PoolInfo,
    key: &(String, String),
) -> Result<Observed, SourceError> {
    let percentile = f64::from(pa.spec.slo.percentile);
    match pa.spec.metrics.source {
        MetricsSource::Prometheus => {
            let url = pa
                .spec
                .metrics
                .prometheus
                .as_ref()
                .map(|p| p.url.clone())
                .unwrap_or_default();
            let window = u64::try_from(pa.spec.planner.interval_seconds.max(30)).unwrap_or(30);
            source::prometheus(
                &ctx.http,
                &url,
                namespace,
                &pa.spec.pool_ref.name,
                window,
                percentile,
            )
            .await
        }
        MetricsSource::Epp => {
            let service = pool.epp_service.clone().ok_or_else(|| {
                SourceError::Service(
                    "(none)".into(),
                    "the InferencePool names no endpoint picker".into(),
                )
            })?;
            let port = pa
                .spec
                .metrics
                .epp_metrics_port_name
                .clone()
                .unwrap_or_else(|| "http-metrics".into());
            let targets = source::epp_targets(&ctx.client, namespace, &service, &port).await?;
            let snapshot = source::scrape(&ctx.http, &targets, now_s()).await?;
            let previous = {
                let mut states = ctx
                    .states
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                states
                    .get_mut(key)
                    .and_then(|s| s.previous.replace(snapshot.clone()))
            };
            source::observe(previous.as_ref(), &snapshot, percentile)
        }
    }
}

/// The status being built, and the conditions' previous transition times.
struct Report {
    status: PoolAutoscalerStatus,
    previous: Vec<Condition>,
    generation: Option<i64>,
    events: Vec<(EventType, String, String)>,
    /// Whether this reconcile found the autoscaler unable to act.
    failed: bool,
}

impl Report {
    fn new(pa: &PoolAutoscaler) -> Self {
        let previous = pa.status.clone().unwrap_or_default();
        Self {
            status: PoolAutoscalerStatus {
                observed_generation: pa.metadata.generation,
                // Keep what is not recomputed on a short reconcile.
                ..previous.clone()
            },
            previous: previous.conditions,
            generation: pa.metadata.generation,
            events: Vec::new(),
            failed: false,
        }
    }

    fn condition(&mut self, type_: &str, status: bool, reason: &str, message: String) {
        let status = if status { "True" } else { "False" };
        let last = self
            .previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone());
        let c = Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation: self.generation,
            last_transition_time: last.unwrap_or(Time(Timestamp::now())),
        };
        self.status.conditions.retain(|x| x.type_ != type_);
        self.status.conditions.push(c);
        self.status.conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
    }

    fn not_ready(&mut self, reason: &str, message: String) {
        self.failed = true;
        self.condition("Ready", false, reason, message);
    }

    async fn event(
        &mut self,
        ctx: &Context,
        pa: &PoolAutoscaler,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        if self.events.iter().any(|(_, r, n)| r == reason && n == note) {
            return;
        }
        self.events
            .push((type_, reason.to_owned(), note.to_owned()));
        if let Err(e) = ctx
            .events
            .publish(&pa.object_ref(&()), type_, reason, "Reconcile", note)
            .await
        {
            tracing::warn!(error = %e, %reason, "event not recorded");
        }
    }

    fn decided(
        &mut self,
        pa: &PoolAutoscaler,
        current: &BTreeMap<Role, Replicas>,
        decision: &Decision,
        observed: Option<Observed>,
        metrics_error: Option<(&'static str, String)>,
        scaled_now: &BTreeMap<Role, String>,
    ) {
        let previous = pa.status.clone().unwrap_or_default().roles;
        let role_status = |role: Role, prev: Option<&RoleStatus>| {
            current.get(&role).map(|r| RoleStatus {
                current_replicas: r.spec,
                desired_replicas: decision
                    .desired
                    .get(&role)
                    .map_or(r.spec, |n| i32::try_from(*n).unwrap_or(i32::MAX)),
                last_scale_time: scaled_now
                    .get(&role)
                    .cloned()
                    .or_else(|| prev.and_then(|p| p.last_scale_time.clone())),
            })
        };
        self.status.roles = RoleStatuses {
            prefill: role_status(Role::Prefill, previous.prefill.as_ref()),
            decode: role_status(Role::Decode, previous.decode.as_ref()),
            both: role_status(Role::Both, previous.both.as_ref()),
        };
        self.status.observed = observed.map(|o| ObservedLoad {
            rps: o.rps,
            isl_tokens: o.isl_tokens,
            osl_tokens: o.osl_tokens,
            ttft_ms: o.ttft_ms,
            itl_ms: o.itl_ms,
        });
        self.status.predicted = decision.predicted.map(|l| ObservedLoad {
            rps: l.rps,
            isl_tokens: l.isl_tokens,
            osl_tokens: l.osl_tokens,
            ttft_ms: None,
            itl_ms: None,
        });
        self.status.last_decision = Some(decision.reason.to_string());
        self.status.last_decision_time = Some(now_rfc3339());
        let gpus: i64 = plan::roles(&pa.spec)
            .iter()
            .map(|(role, t)| {
                i64::from(decision.desired.get(role).copied().unwrap_or(0))
                    * i64::from(t.gpus_per_replica)
            })
            .sum();
        self.status.gpus = i32::try_from(gpus).ok();
        let rolling = current.values().any(|r| r.status != r.spec);
        let changing = !scaled_now.is_empty();
        self.condition(
            "Scaling",
            rolling || changing,
            if changing {
                "Scaled"
            } else if rolling {
                "Rolling"
            } else {
                "Stable"
            },
            if rolling || changing {
                "targets are changing replicas".into()
            } else {
                "every target has its desired replicas".into()
            },
        );
        match metrics_error {
            None => self.condition(
                "MetricsAvailable",
                true,
                "Observed",
                "load and latency read".into(),
            ),
            Some((reason, message)) => self.condition(
                "MetricsAvailable",
                false,
                reason,
                format!("{message}; the planner holds the replicas"),
            ),
        }
        self.condition(
            "BudgetLimited",
            decision.budget_limited,
            if decision.budget_limited {
                "BudgetBinds"
            } else {
                "WithinBudget"
            },
            format!("{} GPUs desired", gpus),
        );
        if !self.failed {
            self.condition("Ready", true, "Planned", decision.reason.to_string());
        }
    }

    async fn write(&self, ctx: &Context, pa: &PoolAutoscaler) -> Result<(), ReconcileError> {
        let namespace = pa.namespace().unwrap_or_default();
        let api: Api<PoolAutoscaler> = Api::namespaced(ctx.client.clone(), &namespace);
        let patch = serde_json::json!({ "status": self.status });
        api.patch_status(
            &pa.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|source| ReconcileError::Status {
            name: pa.name_any(),
            source,
        })?;
        Ok(())
    }
}

/// A failed reconcile: counted, logged, retried.
pub fn error_policy(pa: Arc<PoolAutoscaler>, error: &ReconcileError, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconciled(false);
    tracing::warn!(autoscaler = %pa.name_any(), %error, "reconcile failed; retrying");
    Action::requeue(RETRY)
}

/// Runs the controller on `namespace` (every namespace when `None`) until `shutdown`.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let (pas, pods): (Api<PoolAutoscaler>, Api<Pod>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    let controller = Controller::new(pas, watcher::Config::default());
    let store = controller.store();
    // Deleted autoscalers (no finalizer, so no reconcile tells): forget them within seconds.
    let known = store.clone();
    let pruning = {
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PRUNE_EVERY).await;
                if known.is_empty() && ctx.tracked() == 0 {
                    continue;
                }
                let live: Vec<(String, String)> = known
                    .state()
                    .iter()
                    .map(|pa| (pa.namespace().unwrap_or_default(), pa.name_any()))
                    .collect();
                ctx.retain(&live);
            }
        })
    };
    // A pod change (a prefill pod ready, gone) refreshes the allow-lists of its namespace's
    // autoscalers at once; planning still waits for each autoscaler's interval.
    controller
        .watches(pods, watcher::Config::default(), move |pod: Pod| {
            let ns = pod.metadata.namespace.clone();
            store
                .state()
                .into_iter()
                .filter(|pa| pa.metadata.namespace == ns)
                .map(|pa| ObjectRef::from_obj(&*pa))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, Arc::clone(&ctx))
        .for_each(|result| {
            let ctx = Arc::clone(&ctx);
            async move {
                match result {
                    Ok(_) => ctx.metrics.reconciled(true),
                    Err(e) => tracing::debug!(error = %e, "controller"),
                }
            }
        })
        .await;
    pruning.abort();
}
