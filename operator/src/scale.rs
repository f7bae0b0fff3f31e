//! Reading and setting a workload's replicas through its `/scale` subresource, whatever its
//! kind (Deployment, StatefulSet, LeaderWorkerSet, …): the kind is resolved by API discovery
//! once and cached, and a write carries the Scale's `resourceVersion`, retried on a conflict.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::autoscaling::v1::Scale;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiResource, pinned_kind};

use api::autoscaler::ScaleTargetRef;

/// Conflicts retried before a write gives up.
const CONFLICT_RETRIES: usize = 3;

/// Why a scale could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// `apiVersion` is not `group/version` or `version`.
    #[error("scaleTargetRef {0}: apiVersion must be group/version or version")]
    BadApiVersion(String),
    /// The kind is not served, or has no `/scale` subresource.
    #[error("{kind} ({api_version}) is not served with a /scale subresource: {source}")]
    Kind {
        /// The kind.
        kind: String,
        /// Its version.
        api_version: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The kind is served but has no `/scale` subresource.
    #[error("{kind} ({api_version}) has no /scale subresource")]
    NoScale {
        /// The kind.
        kind: String,
        /// Its version.
        api_version: String,
    },
    /// The workload does not exist.
    #[error("{kind} {name} not found")]
    Missing {
        /// The kind.
        kind: String,
        /// The name.
        name: String,
    },
    /// The API server refused or failed.
    #[error("{kind} {name}/scale: {source}")]
    Api {
        /// The kind.
        kind: String,
        /// The name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

impl ScaleError {
    /// A bounded label for metrics and condition reasons.
    pub fn reason(&self) -> &'static str {
        match self {
            ScaleError::BadApiVersion(_) | ScaleError::Kind { .. } | ScaleError::NoScale { .. } => {
                "TargetKindNotScalable"
            }
            ScaleError::Missing { .. } => "TargetMissing",
            ScaleError::Api { .. } => "ScaleFailed",
        }
    }
}

/// A workload's replicas as its Scale reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicas {
    /// `spec.replicas`.
    pub spec: i32,
    /// `status.replicas`.
    pub status: i32,
}

/// Resolves scale targets (discovery cached per group/version/kind) and reads or writes them.
#[derive(Debug, Default)]
pub struct Scaler {
    kinds: Mutex<HashMap<(String, String), ApiResource>>,
}

impl Scaler {
    async fn api(
        &self,
        client: &kube::Client,
        namespace: &str,
        target: &ScaleTargetRef,
    ) -> Result<Api<DynamicObject>, ScaleError> {
        let key = (target.api_version.clone(), target.kind.clone());
        let cached = self
            .kinds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            .cloned();
        let resource = match cached {
            Some(r) => r,
            None => {
                let (group, version) = match target.api_version.split_once('/') {
                    Some((g, v)) => (g, v),
                    None => ("", target.api_version.as_str()),
                };
                if version.is_empty() || target.api_version.matches('/').count() > 1 {
                    return Err(ScaleError::BadApiVersion(target.api_version.clone()));
                }
                let gvk = GroupVersionKind::gvk(group, version, &target.kind);
                let (resource, caps) =
                    pinned_kind(client, &gvk)
                        .await
                        .map_err(|source| ScaleError::Kind {
                            kind: target.kind.clone(),
                            api_version: target.api_version.clone(),
                            source,
                        })?;
                if !caps.subresources.iter().any(|(r, _)| r.plural == "scale") {
                    return Err(ScaleError::NoScale {
                        kind: target.kind.clone(),
                        api_version: target.api_version.clone(),
                    });
                }
                self.kinds
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(key, resource.clone());
                resource
            }
        };
        Ok(Api::namespaced_with(client.clone(), namespace, &resource))
    }

    /// The target's replicas.
    pub async fn get(
        &self,
        client: &kube::Client,
        namespace: &str,
        target: &ScaleTargetRef,
    ) -> Result<Replicas, ScaleError> {
        let api = self.api(client, namespace, target).await?;
        let scale = api
            .get_scale(&target.name)
            .await
            .map_err(|e| self.classify(target, e))?;
        Ok(Replicas {
            spec: scale.spec.and_then(|s| s.replicas).unwrap_or(0),
            status: scale.status.map_or(0, |s| s.replicas),
        })
    }

    /// Sets `spec.replicas`: read, write with the read's resourceVersion, and on a conflict
    /// (someone else wrote between) read and write again, up to three times. Returns the
    /// replicas the target had just before the successful write.
    pub async fn set(
        &self,
        client: &kube::Client,
        namespace: &str,
        target: &ScaleTargetRef,
        replicas: i32,
    ) -> Result<i32, ScaleError> {
        let api = self.api(client, namespace, target).await?;
        let scale = api
            .get_scale(&target.name)
            .await
            .map_err(|e| self.classify(target, e))?;
        self.write_from(&api, target, scale, replicas)
            .await
            .map(|(before, _)| before)
    }

    /// Writes `replicas` over `scale` (as read, with its resourceVersion); on a conflict reads
    /// the Scale again and retries, up to three times. Returns the replicas before the
    /// successful write and the conflicts met.
    pub async fn write_from(
        &self,
        api: &Api<DynamicObject>,
        target: &ScaleTargetRef,
        mut scale: Scale,
        replicas: i32,
    ) -> Result<(i32, usize), ScaleError> {
        let mut conflicts = 0;
        loop {
            let before = scale.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
            scale.spec.get_or_insert_with(Default::default).replicas = Some(replicas);
            match api
                .replace_scale(&target.name, &PostParams::default(), &scale)
                .await
            {
                Ok(_) => return Ok((before, conflicts)),
                Err(kube::Error::Api(s)) if s.code == 409 && conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    tracing::info!(target = %target.name, conflicts, "scale conflict: someone wrote first; reading again");
                    scale = api
                        .get_scale(&target.name)
                        .await
                        .map_err(|e| self.classify(target, e))?;
                }
                Err(e) => return Err(self.classify(target, e)),
            }
        }
    }

    /// The API of a target's kind (resolved by discovery once).
    pub async fn api_for(
        &self,
        client: &kube::Client,
        namespace: &str,
        target: &ScaleTargetRef,
    ) -> Result<Api<DynamicObject>, ScaleError> {
        self.api(client, namespace, target).await
    }

    fn classify(&self, target: &ScaleTargetRef, e: kube::Error) -> ScaleError {
        match e {
            kube::Error::Api(s) if s.code == 404 => ScaleError::Missing {
                kind: target.kind.clone(),
                name: target.name.clone(),
            },
            source => ScaleError::Api {
                kind: target.kind.clone(),
                name: target.name.clone(),
                source,
            },
        }
    }
}
