//! Leader election on a `coordination.k8s.io/v1` Lease: one replica acts, the others wait; when
//! the leader stops renewing, another takes over once the lease has expired.
//!
//! [`decide`] is the pure rule (who may hold the lease now); [`Elector`] runs it against the API
//! server with optimistic concurrency (a write carries the lease's `resourceVersion`, so two
//! candidates cannot both win) and publishes leadership on a `watch` channel. A leader that
//! cannot renew steps down at its renew deadline, before any other replica may take over.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;

/// The lease as the rule sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseView {
    /// Who holds it.
    pub holder: Option<String>,
    /// When the holder last renewed it, seconds since the epoch.
    pub renewed_s: Option<f64>,
    /// How long a renewal holds, seconds.
    pub duration_s: f64,
    /// How many times it changed hands.
    pub transitions: i32,
}

/// What a candidate does now.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Create the lease (none exists).
    Create,
    /// Renew it (it is ours).
    Renew,
    /// Take it over (free or expired); the transition count goes up.
    Take {
        /// The new transition count.
        transitions: i32,
    },
    /// Someone else holds it; check again later.
    Follow {
        /// The holder.
        holder: String,
        /// Seconds until it expires unless renewed.
        expires_in_s: f64,
    },
}

/// Who may hold the lease at `now_s`, from `me`'s point of view.
pub fn decide(lease: Option<&LeaseView>, me: &str, now_s: f64) -> Step {
    let Some(l) = lease else {
        return Step::Create;
    };
    match (&l.holder, l.renewed_s) {
        (Some(h), _) if h == me => Step::Renew,
        (Some(h), Some(renewed)) if !h.is_empty() && now_s < renewed + l.duration_s => {
            Step::Follow {
                holder: h.clone(),
                expires_in_s: renewed + l.duration_s - now_s,
            }
        }
        _ => Step::Take {
            transitions: l.transitions + 1,
        },
    }
}

/// How the election runs.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a renewal holds.
    pub lease_duration: Duration,
    /// How long a leader keeps trying to renew before it steps down (less than the duration).
    pub renew_deadline: Duration,
    /// How often candidates and the leader act.
    pub retry_period: Duration,
}

/// Why an election step failed.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    /// The API server refused or failed.
    #[error("lease {name}: {source}")]
    Api {
        /// The lease.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

/// Runs the election until the future is dropped, publishing whether this replica leads.
#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    config: ElectionConfig,
    leading: watch::Sender<bool>,
}

fn now_s() -> f64 {
    Timestamp::now().as_millisecond() as f64 / 1000.0
}

impl Elector {
    /// An elector; `subscribe` to follow leadership.
    pub fn new(client: kube::Client, config: ElectionConfig) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            leading: watch::channel(false).0,
        }
    }

    /// Leadership, `true` while this replica leads.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Campaigns and renews forever.
    pub async fn run(self) {
        let mut last_renewed: Option<tokio::time::Instant> = None;
        loop {
            match self.step().await {
                Ok(true) => {
                    if !*self.leading.borrow() {
                        tracing::info!(
                            lease = %self.config.name,
                            identity = %self.config.identity,
                            "leading: this replica acts"
                        );
                    }
                    last_renewed = Some(tokio::time::Instant::now());
                    self.leading.send_replace(true);
                }
                Ok(false) => {
                    if *self.leading.borrow() {
                        tracing::warn!(lease = %self.config.name, "another replica holds the lease: stepping down");
                    }
                    self.leading.send_replace(false);
                }
                Err(e) => {
                    let overdue =
                        last_renewed.is_none_or(|t| t.elapsed() >= self.config.renew_deadline);
                    if *self.leading.borrow() && overdue {
                        tracing::warn!(error = %e, "lease not renewed before the deadline: stepping down");
                        self.leading.send_replace(false);
                    } else {
                        tracing::debug!(error = %e, "lease step failed; retrying");
                    }
                }
            }
            tokio::time::sleep(self.config.retry_period).await;
        }
    }

    /// One round: read the lease, apply the rule, write. `Ok(true)` when this replica holds it.
    async fn step(&self) -> Result<bool, ElectionError> {
        let err = |source| ElectionError::Api {
            name: self.config.name.clone(),
            source,
        };
        let current = match self.api.get(&self.config.name).await {
            Ok(l) => Some(l),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(err(e)),
        };
        let view = current.as_ref().map(view_of);
        let me = &self.config.identity;
        let duration = i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let now = MicroTime(Timestamp::now());
        let write = match decide(view.as_ref(), me, now_s()) {
            Step::Follow { .. } => return Ok(false),
            Step::Create => None,
            Step::Renew | Step::Take { .. } => current,
        };
        let result = match write {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(me.clone()),
                        lease_duration_seconds: Some(duration),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if spec.holder_identity.as_deref() != Some(me.as_str()) {
                    spec.holder_identity = Some(me.clone());
                    spec.acquire_time = Some(now.clone());
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(duration);
                spec.renew_time = Some(now);
                // The resourceVersion read above makes this a compare-and-swap.
                self.api
                    .replace(&self.config.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            // Another candidate wrote first.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(err(e)),
        }
    }
}

fn view_of(l: &Lease) -> LeaseView {
    let spec = l.spec.clone().unwrap_or_default();
    LeaseView {
        holder: spec.holder_identity,
        renewed_s: spec
            .renew_time
            .map(|t| t.0.as_millisecond() as f64 / 1000.0),
        duration_s: f64::from(spec.lease_duration_seconds.unwrap_or(15)),
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

/// Gives the lease up if this replica holds it (on shutdown), so another takes over at once
/// instead of after the lease expires.
pub async fn release(client: kube::Client, config: &ElectionConfig) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let Ok(mut lease) = api.get(&config.name).await else {
        return;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    match api
        .replace(&config.name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => tracing::info!(lease = %config.name, "lease released"),
        Err(e) => {
            tracing::warn!(lease = %config.name, error = %e, "lease not released; it expires on its own")
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use proptest::prelude::*;

    use super::*;

    fn lease(holder: Option<&str>, renewed: Option<f64>) -> LeaseView {
        LeaseView {
            holder: holder.map(str::to_owned),
            renewed_s: renewed,
            duration_s: 15.0,
            transitions: 2,
        }
    }

    #[test]
    fn the_rule() {
        assert_eq!(decide(None, "a", 0.0), Step::Create);
        assert_eq!(
            decide(Some(&lease(Some("a"), Some(0.0))), "a", 100.0),
            Step::Renew
        );
        assert_eq!(
            decide(Some(&lease(Some("b"), Some(10.0))), "a", 20.0),
            Step::Follow {
                holder: "b".into(),
                expires_in_s: 5.0
            }
        );
        assert_eq!(
            decide(Some(&lease(Some("b"), Some(10.0))), "a", 25.0),
            Step::Take { transitions: 3 },
            "expired"
        );
        assert_eq!(
            decide(Some(&lease(None, None)), "a", 0.0),
            Step::Take { transitions: 3 },
            "released"
        );
    }

    proptest! {
        /// Against a naive model of many candidates sharing one lease (each step applied
        /// atomically, as the resourceVersion check makes it): at no time do two candidates
        /// both believe they lead, given a leader steps down once its renewal is older than
        /// the renew deadline (shorter than the lease).
        #[test]
        fn never_two_leaders(
            schedule in prop::collection::vec((0usize..3, 0.0f64..6.0, any::<bool>()), 1..200),
        ) {
            let names = ["a", "b", "c"];
            let (duration, deadline) = (15.0, 10.0);
            let mut lease: Option<LeaseView> = None;
            let mut last_ok: [Option<f64>; 3] = [None; 3];
            let mut now = 0.0;
            for (who, dt, reachable) in schedule {
                now += dt;
                if reachable {
                    let step = decide(lease.as_ref(), names[who], now);
                    match step {
                        // It learns someone else leads.
                        Step::Follow { .. } => last_ok[who] = None,
                        Step::Create | Step::Renew | Step::Take { .. } => {
                            let transitions = match step {
                                Step::Take { transitions } => transitions,
                                _ => lease.as_ref().map_or(0, |l| l.transitions),
                            };
                            lease = Some(LeaseView {
                                holder: Some(names[who].to_owned()),
                                renewed_s: Some(now),
                                duration_s: duration,
                                transitions,
                            });
                            // The others learn nothing until their own next step: each
                            // still believes it leads until its renew deadline.
                            last_ok[who] = Some(now);
                        }
                    }
                }
                let leaders = last_ok
                    .iter()
                    .filter(|t| t.is_some_and(|t| now - t < deadline))
                    .count();
                prop_assert!(leaders <= 1, "{leaders} leaders at {now}");
            }
        }
    }
}
