//! Where the Kubernetes tools are.

use std::path::{Path, PathBuf};

use crate::KapiError;

/// The programs: the API server and etcd, and the clients tests drive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    /// `kapi`.
    pub kapi: PathBuf,
    /// `etcd`.
    pub etcd: PathBuf,
    /// `kubectl`.
    pub kubectl: PathBuf,
    /// `helm`.
    pub helm: PathBuf,
}

impl Tools {
    /// The tools in `$KVGATE_KUBE_BIN`, else in the workspace's `.cache/kube/bin`; an error
    /// names the first one missing.
    pub fn locate() -> Result<Tools, KapiError> {
        let dir = std::env::var_os("KVGATE_KUBE_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(default_dir);
        Tools::in_dir(&dir)
    }

    /// The tools in `dir`.
    pub fn in_dir(dir: &Path) -> Result<Tools, KapiError> {
        let find = |name: &'static str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(KapiError::MissingTool { name, path })
            }
        };
        Ok(Tools {
            kapi: find("kapi")?,
            etcd: find("etcd")?,
            kubectl: find("kubectl")?,
            helm: find("helm")?,
        })
    }
}

/// The workspace root (this crate is `e2e/kapi`).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn default_dir() -> PathBuf {
    workspace_root().join(".cache/kube/bin")
}
