//! A rendered container as a local process: how the tests run the chart's own command lines on
//! one machine. Pure: the caller supplies the objects a kubelet would read and writes the files.
//!
//! The emulation, rule by rule (each one what a kubelet and a pod network would otherwise do):
//!
//! - **Image → program.** A kvgate image (`…/kvgate-<name>:<tag>`) runs the `kvgate-<name>`
//!   binary of this build; its entrypoint is the binary, so the container's `args` are the
//!   command line. Other images are refused.
//! - **Pod network.** Each pod gets a loopback address of its own (`127.x.y.z`). Pods share this
//!   machine's loopback, so what a pod means by "itself" is rewritten to its address: in
//!   arguments `127.0.0.1`, `localhost` in URLs and `0.0.0.0` become the pod's IP, and every
//!   process gets `KVGATE_LISTEN_ADDRESS=<pod IP>` for the sockets it binds on all interfaces
//!   (servers without an address flag, and ZMQ's `tcp://*:` binds, which must stay wildcards:
//!   an endpoint naming a host is connected to, not bound, as in vLLM).
//! - **Environment.** `value`, `fieldRef` (name, namespace, pod IP, node, service account) and
//!   `secretKeyRef`/`configMapKeyRef` (read from the API server by the caller; `optional` kept),
//!   then `$(VAR)` references in arguments expanded as Kubernetes does.
//! - **Volumes.** Each mount's `mountPath` is a directory of the run directory (the caller fills
//!   Secret and ConfigMap volumes from the API server); arguments naming a path under a mount
//!   are rewritten to the local directory. A missing Secret or ConfigMap fails the pod's start
//!   unless the volume is `optional` (then the directory starts empty).
//! - **ConfigMap volumes follow the API server.** As a kubelet's do, every mounted ConfigMap is
//!   re-read while its pod runs (here every 500 ms; a kubelet's sync period and cache make that
//!   up to about a minute) and changed keys are rewritten atomically (a temporary file renamed
//!   over the old one, so a reader sees the old content or the new, never a part); keys that
//!   went away are removed, and an `optional` ConfigMap created after the pod started appears
//!   then. Secret volumes are written once, at the pod's start.
//! - **Pod objects.** A pod is registered with its template's labels and containers (names,
//!   images, ports: what a Service's named `targetPort` resolves against), its IP, and `Ready`
//!   once its containers' readiness probes pass.
//! - **ServiceAccount token.** kapi has no TokenRequest: a pod with a mounted token gets
//!   `KUBECONFIG` for a kubeconfig holding a static token of its ServiceAccount.

// serde_json's `Value[&str]` and `Value[usize]` return `Null` for a missing key or a value of
// another type; they never panic, and the rendered manifests are read through them.
#![allow(clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The pod a container runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContext {
    /// Pod name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Node name.
    pub node: String,
    /// The pod's own loopback address.
    pub ip: Ipv4Addr,
    /// The pod's ServiceAccount.
    pub service_account: String,
}

/// A container ready to start here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The container's name.
    pub container: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments, rewritten.
    pub args: Vec<String>,
    /// Its environment.
    pub env: Vec<(String, String)>,
}

/// Why a container cannot be run here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// Not a kvgate image.
    #[error("container {container}: image {image:?} is not a kvgate image this build can run")]
    Image {
        /// The container.
        container: String,
        /// Its image.
        image: String,
    },
    /// An environment variable references something missing.
    #[error("container {container}: env {name}: {problem}")]
    Env {
        /// The container.
        container: String,
        /// The variable.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

/// What a kubelet would read from the API server for env references.
pub trait Lookup {
    /// A ConfigMap's key, `None` when the object or key is missing.
    fn config_map_key(&self, name: &str, key: &str) -> Option<String>;
    /// A Secret's key (decoded), `None` when missing.
    fn secret_key(&self, name: &str, key: &str) -> Option<String>;
}

/// The program of a kvgate image: `…/kvgate-epp:0.1.0` → `<bin_dir>/kvgate-epp`.
pub fn program_for(container: &Value, bin_dir: &Path) -> Result<PathBuf, LaunchError> {
    let name = container["name"].as_str().unwrap_or_default();
    let image = container["image"].as_str().unwrap_or_default();
    let last = image.rsplit('/').next().unwrap_or_default();
    let binary = last.split([':', '@']).next().unwrap_or_default();
    if !binary.starts_with("kvgate-") || binary.len() == "kvgate-".len() {
        return Err(LaunchError::Image {
            container: name.to_owned(),
            image: image.to_owned(),
        });
    }
    Ok(bin_dir.join(binary))
}

/// The local directory of each of the container's mounts: `(mountPath, local path)`, longest
/// mount path first. `volume_dir` gives a volume's directory by name.
pub fn mounts(container: &Value, volume_dir: impl Fn(&str) -> PathBuf) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let path = m["mountPath"].as_str()?;
            let volume = m["name"].as_str()?;
            let mut local = volume_dir(volume);
            if let Some(sub) = m["subPath"].as_str().filter(|s| !s.is_empty()) {
                local = local.join(sub);
            }
            Some((path.trim_end_matches('/').to_owned(), local))
        })
        .collect();
    out.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    out
}

/// The container's environment, resolved for `pod`.
pub fn env(
    container: &Value,
    pod: &PodContext,
    lookup: &dyn Lookup,
) -> Result<Vec<(String, String)>, LaunchError> {
    let cname = container["name"].as_str().unwrap_or_default();
    let err = |name: &str, problem: String| LaunchError::Env {
        container: cname.to_owned(),
        name: name.to_owned(),
        problem,
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap_or_default();
        if let Some(v) = e["value"].as_str() {
            let expanded = expand(v, &out);
            out.push((name.to_owned(), expanded));
            continue;
        }
        let from = &e["valueFrom"];
        let optional = |r: &Value| r["optional"].as_bool().unwrap_or(false);
        let value = if let Some(path) = from["fieldRef"]["fieldPath"].as_str() {
            Some(match path {
                "metadata.name" => pod.name.clone(),
                "metadata.namespace" => pod.namespace.clone(),
                "status.podIP" | "status.hostIP" => pod.ip.to_string(),
                "spec.nodeName" => pod.node.clone(),
                "spec.serviceAccountName" => pod.service_account.clone(),
                other => return Err(err(name, format!("fieldRef {other} is not emulated"))),
            })
        } else if from["secretKeyRef"].is_object() {
            let r = &from["secretKeyRef"];
            let (obj, key) = (r["name"].as_str(), r["key"].as_str());
            match obj.zip(key).and_then(|(o, k)| lookup.secret_key(o, k)) {
                Some(v) => Some(v),
                None if optional(r) => None,
                None => return Err(err(name, format!("secret key {r} missing"))),
            }
        } else if from["configMapKeyRef"].is_object() {
            let r = &from["configMapKeyRef"];
            let (obj, key) = (r["name"].as_str(), r["key"].as_str());
            match obj.zip(key).and_then(|(o, k)| lookup.config_map_key(o, k)) {
                Some(v) => Some(v),
                None if optional(r) => None,
                None => return Err(err(name, format!("configMap key {r} missing"))),
            }
        } else {
            return Err(err(name, format!("unsupported source {from}")));
        };
        if let Some(v) = value {
            out.push((name.to_owned(), v));
        }
    }
    Ok(out)
}

/// Kubernetes' `$(VAR)` expansion against the variables defined so far (`$$(` escapes;
/// unknown references stay as written).
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(inner) = tail.strip_prefix("$(")
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// One argument as it runs here: mount paths to local directories, then the pod's own
/// addresses to its IP.
pub fn rewrite_arg(arg: &str, ip: Ipv4Addr, mounts: &[(String, PathBuf)]) -> String {
    let mut arg = arg.to_owned();
    for (path, local) in mounts {
        if let Some(i) = arg.find(path.as_str()) {
            let end = i + path.len();
            let boundary = arg[end..].chars().next().is_none_or(|c| c == '/');
            if boundary {
                arg = format!("{}{}{}", &arg[..i], local.display(), &arg[end..]);
                break;
            }
        }
    }
    let ip = ip.to_string();
    arg.replace("127.0.0.1", &ip)
        .replace("//localhost:", &format!("//{ip}:"))
        .replace("0.0.0.0", &ip)
}

/// The container as a local process.
pub fn launch(
    container: &Value,
    pod: &PodContext,
    bin_dir: &Path,
    mounts: &[(String, PathBuf)],
    lookup: &dyn Lookup,
) -> Result<Launch, LaunchError> {
    let program = program_for(container, bin_dir)?;
    let mut env = env(container, pod, lookup)?;
    let args = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|a| rewrite_arg(&expand(a, &env), pod.ip, mounts))
        .collect();
    env.push(("KVGATE_LISTEN_ADDRESS".to_owned(), pod.ip.to_string()));
    Ok(Launch {
        container: container["name"].as_str().unwrap_or_default().to_owned(),
        program,
        args,
        env,
    })
}

/// The value of `--flag=value` or `--flag value` in `args`.
pub fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
        if a == flag {
            return it.next().map(String::as_str);
        }
    }
    None
}

/// A container's named ports.
pub fn ports(container: &Value) -> BTreeMap<String, u16> {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let port = u16::try_from(p["containerPort"].as_u64()?).ok()?;
            Some((p["name"].as_str()?.to_owned(), port))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use serde_json::json;

    use super::*;

    struct Objects;
    impl Lookup for Objects {
        fn config_map_key(&self, name: &str, key: &str) -> Option<String> {
            (name == "cm" && key == "k").then(|| "from-cm".to_owned())
        }
        fn secret_key(&self, name: &str, key: &str) -> Option<String> {
            (name == "s" && key == "url").then(|| "redis://x".to_owned())
        }
    }

    fn pod() -> PodContext {
        PodContext {
            name: "p-0".into(),
            namespace: "llm".into(),
            node: "node-a".into(),
            ip: Ipv4Addr::new(127, 1, 2, 3),
            service_account: "sa".into(),
        }
    }

    #[test]
    fn a_container_becomes_a_local_process() {
        let c = json!({
            "name": "kvgate-sidecar",
            "image": "ghcr.io/kvgate/kvgate-sidecar:0.1.0",
            "args": ["--engine-url=http://127.0.0.1:8200", "--kv-events-endpoint=tcp://127.0.0.1:5557",
                     "--prefiller-allow-list=/etc/kvgate/prefillers/prefillers.yaml",
                     "--kv-events-config={\"endpoint\":\"tcp://*:5557\"}", "--host=0.0.0.0",
                     "--pod=$(POD_NAME)", "--literal=$$(POD_NAME)", "--url=http://localhost:9"],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "URL", "valueFrom": {"secretKeyRef": {"name": "s", "key": "url"}}},
                {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "no", "optional": true}}},
                {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
                {"name": "RUST_LOG", "value": "info"}
            ],
            "volumeMounts": [{"name": "kvgate-prefillers", "mountPath": "/etc/kvgate/prefillers"}]
        });
        let m = mounts(&c, |v| PathBuf::from("/run/x").join(v));
        let l = launch(&c, &pod(), Path::new("/bin"), &m, &Objects).unwrap();
        assert_eq!(l.program, PathBuf::from("/bin/kvgate-sidecar"));
        assert_eq!(
            l.args,
            vec![
                "--engine-url=http://127.1.2.3:8200",
                "--kv-events-endpoint=tcp://127.1.2.3:5557",
                "--prefiller-allow-list=/run/x/kvgate-prefillers/prefillers.yaml",
                "--kv-events-config={\"endpoint\":\"tcp://*:5557\"}",
                "--host=127.1.2.3",
                "--pod=p-0",
                "--literal=$(POD_NAME)",
                "--url=http://127.1.2.3:9",
            ]
        );
        let env: BTreeMap<_, _> = l.env.into_iter().collect();
        assert_eq!(env["POD_IP"], "127.1.2.3");
        assert_eq!(env["NODE"], "node-a");
        assert_eq!(env["URL"], "redis://x");
        assert_eq!(env["CM"], "from-cm");
        assert_eq!(env["KVGATE_LISTEN_ADDRESS"], "127.1.2.3");
        assert!(
            !env.contains_key("OPT"),
            "an optional missing key is left unset"
        );
    }

    #[test]
    fn missing_references_and_foreign_images_are_errors() {
        let c = json!({"name": "x", "image": "vllm/vllm-openai:v0.32.0"});
        assert!(matches!(
            program_for(&c, Path::new("/bin")),
            Err(LaunchError::Image { .. })
        ));
        let c = json!({"name": "x", "image": "kvgate-epp",
                       "env": [{"name": "U", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}]});
        assert!(matches!(
            launch(&c, &pod(), Path::new("/bin"), &[], &Objects),
            Err(LaunchError::Env { .. })
        ));
    }

    #[test]
    fn flags_and_ports_are_read_both_ways() {
        let args: Vec<String> = ["--a=1", "--b", "2", "--ab=3"].map(String::from).to_vec();
        assert_eq!(flag(&args, "--a"), Some("1"));
        assert_eq!(flag(&args, "--b"), Some("2"));
        assert_eq!(flag(&args, "--c"), None);
        let c = json!({"ports": [{"name": "http-metrics", "containerPort": 9090}, {"containerPort": 1}]});
        assert_eq!(ports(&c)["http-metrics"], 9090);
    }
}
