//! The Helm chart (`charts/kvgate`) through the `helm` binary: lint, template, install and
//! upgrade, and the rendered objects as JSON values to read containers from.

// serde_json's `Value[&str]` and `Value[usize]` return `Null` for a missing key or a value of
// another type; they never panic, and the rendered manifests are read through them.
#![allow(clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Why a Helm operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// `helm` could not be run.
    #[error("running {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `helm` exited with an error (its stderr).
    #[error("helm {command} failed: {stderr}")]
    Helm {
        /// The subcommand.
        command: String,
        /// What it printed.
        stderr: String,
    },
    /// The rendered output is not YAML.
    #[error("rendered manifests: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
    /// A values file could not be written.
    #[error("writing values: {0}")]
    Io(#[from] std::io::Error),
}

/// The kvgate chart in this workspace.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("charts/kvgate")
}

/// The workspace root (this crate is `e2e`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `helm` binary, optionally bound to a cluster.
#[derive(Debug, Clone)]
pub struct Helm {
    program: PathBuf,
    kubeconfig: Option<PathBuf>,
    scratch: PathBuf,
}

impl Helm {
    /// `program`, writing values files into `scratch`.
    pub fn new(program: impl Into<PathBuf>, scratch: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            kubeconfig: None,
            scratch: scratch.into(),
        }
    }

    /// Talks to the cluster of `kubeconfig` (install, upgrade, lookups in templates).
    pub fn with_kubeconfig(mut self, kubeconfig: impl Into<PathBuf>) -> Self {
        self.kubeconfig = Some(kubeconfig.into());
        self
    }

    /// `helm lint --strict` of the chart with `values` (YAML documents).
    pub fn lint(&self, values: &[&str]) -> Result<String, ChartError> {
        let mut args = vec!["lint".to_owned(), "--strict".to_owned()];
        args.push(chart_dir().display().to_string());
        args.extend(self.values_args(values)?);
        self.run("lint", &args)
    }

    /// `helm template` of the chart as `release` in `namespace`.
    pub fn template(
        &self,
        release: &str,
        namespace: &str,
        values: &[&str],
    ) -> Result<Rendered, ChartError> {
        Rendered::parse(&self.release("template", release, namespace, values, &[])?)
    }

    /// `helm install` (server-side apply, which refuses undeclared fields) into the cluster.
    pub fn install(
        &self,
        release: &str,
        namespace: &str,
        values: &[&str],
    ) -> Result<String, ChartError> {
        self.release(
            "install",
            release,
            namespace,
            values,
            &["--create-namespace"],
        )
    }

    /// `helm upgrade` of an installed release.
    pub fn upgrade(
        &self,
        release: &str,
        namespace: &str,
        values: &[&str],
    ) -> Result<String, ChartError> {
        self.release("upgrade", release, namespace, values, &[])
    }

    /// `helm <command> <release> <chart> --namespace <namespace> [extra] -f <values>…`.
    fn release(
        &self,
        command: &str,
        release: &str,
        namespace: &str,
        values: &[&str],
        extra: &[&str],
    ) -> Result<String, ChartError> {
        let mut args = vec![
            command.to_owned(),
            release.to_owned(),
            chart_dir().display().to_string(),
            "--namespace".to_owned(),
            namespace.to_owned(),
        ];
        args.extend(extra.iter().map(|e| (*e).to_owned()));
        args.extend(self.values_args(values)?);
        self.run(command, &args)
    }

    /// The release's rendered manifests as installed (`helm get manifest`).
    pub fn manifest(&self, release: &str, namespace: &str) -> Result<Rendered, ChartError> {
        let args = [
            "get".to_owned(),
            "manifest".to_owned(),
            release.to_owned(),
            "--namespace".to_owned(),
            namespace.to_owned(),
        ];
        Rendered::parse(&self.run("get manifest", &args)?)
    }

    fn values_args(&self, values: &[&str]) -> Result<Vec<String>, ChartError> {
        std::fs::create_dir_all(&self.scratch)?;
        let mut args = Vec::new();
        for text in values {
            let path = self.scratch.join(format!(
                "values-{}.yaml",
                VALUES_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            std::fs::write(&path, text)?;
            args.push("-f".to_owned());
            args.push(path.display().to_string());
        }
        Ok(args)
    }

    fn run(&self, command: &str, args: &[String]) -> Result<String, ChartError> {
        let mut cmd = Command::new(&self.program);
        cmd.args(args);
        if let Some(k) = &self.kubeconfig {
            cmd.arg("--kubeconfig").arg(k);
        }
        let out = cmd.output().map_err(|source| ChartError::Spawn {
            program: self.program.clone(),
            source,
        })?;
        if !out.status.success() {
            return Err(ChartError::Helm {
                command: command.to_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

static VALUES_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Rendered Kubernetes objects.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rendered {
    /// Every object, in the order rendered.
    pub objects: Vec<Value>,
}

impl Rendered {
    /// Parses a multi-document YAML stream (empty documents skipped).
    pub fn parse(text: &str) -> Result<Rendered, ChartError> {
        let mut objects = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(text) {
            let value: Value = serde::Deserialize::deserialize(doc)?;
            if value.is_object() {
                objects.push(value);
            }
        }
        Ok(Rendered { objects })
    }

    /// The objects of `kind`.
    pub fn of_kind<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
        let kind = kind.to_owned();
        self.objects
            .iter()
            .filter(move |o| o["kind"] == kind.as_str())
    }

    /// The object of `kind` named `name`.
    pub fn get(&self, kind: &str, name: &str) -> Option<&Value> {
        self.of_kind(kind).find(|o| o["metadata"]["name"] == name)
    }

    /// The first object of `kind` whose name ends with `suffix`.
    pub fn find(&self, kind: &str, suffix: &str) -> Option<&Value> {
        self.of_kind(kind).find(|o| {
            o["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with(suffix))
        })
    }

    /// Every container of every workload's pod template, as `(workload kind, workload name,
    /// container)`, init containers included.
    pub fn containers(&self) -> Vec<(String, String, &Value)> {
        let mut out = Vec::new();
        for o in &self.objects {
            let kind = o["kind"].as_str().unwrap_or_default();
            if !matches!(kind, "Deployment" | "StatefulSet" | "DaemonSet" | "Job") {
                continue;
            }
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            let spec = &o["spec"]["template"]["spec"];
            for list in ["initContainers", "containers"] {
                for c in spec[list].as_array().into_iter().flatten() {
                    out.push((kind.to_owned(), name.to_owned(), c));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_stream_parses_into_objects_and_containers() {
        let text = "---\n# Source: x\napiVersion: v1\nkind: Service\nmetadata: {name: a-epp}\n---\n\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a-epp}\nspec:\n  template:\n    spec:\n      containers: [{name: epp, args: [--x]}]\n";
        let r = Rendered::parse(text).unwrap();
        assert_eq!(r.objects.len(), 2);
        assert!(r.get("Service", "a-epp").is_some());
        assert!(r.find("Deployment", "-epp").is_some());
        let c = r.containers();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].2["args"][0], "--x");
    }
}
