//! Where the stack's programs are: kvgate's binaries next to the running executable (the same
//! target directory), Envoy from the workspace's bootstrap venv, `nats-server` on the `PATH`.

use std::path::{Path, PathBuf};

use super::config::{Router, StackConfig};
use super::error::StackError;

/// The programs a stack runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    /// `kvgate-sim`.
    pub sim: PathBuf,
    /// `kvgate-sidecar`.
    pub sidecar: PathBuf,
    /// `kvgate-epp`.
    pub epp: PathBuf,
    /// Envoy.
    pub envoy: PathBuf,
    /// `nats-server`.
    pub nats: PathBuf,
    /// The peer router, when one replaces Envoy and the EPP.
    pub router: Option<PathBuf>,
    /// `kvgate-kvbm` and `redis-server`, when the stack runs the KV block manager.
    pub kvbm: Option<(PathBuf, PathBuf)>,
}

const BUILD_HINT: &str = "build them first: cargo build -p kvgate-e2e -p kvgate-epp -p kvgate-sidecar \
     -p kvgate-kvbm (add --release when running kvgate-bench in release)";

impl Binaries {
    /// Finds every program `config` needs, or says which one is missing and how to get it.
    pub fn locate(config: &StackConfig) -> Result<Binaries, StackError> {
        let dir = match &config.bin_dir {
            Some(d) => d.clone(),
            None => exe_dir()?,
        };
        let kvgate = |name: &str| existing(name, dir.join(name), BUILD_HINT);
        let envoy = match (&config.envoy, config.router) {
            (Some(p), _) => existing("envoy", p.clone(), "pass an existing Envoy binary")?,
            (None, Router::EnvoyEpp) => venv_envoy()?,
            (None, _) => PathBuf::new(),
        };
        let router = match (config.router, &config.router_bin) {
            (Router::EnvoyEpp, _) => None,
            (r, Some(p)) => Some(existing(
                r.program(),
                p.clone(),
                "pass an existing router binary",
            )?),
            (r, None) => Some(peer_router(r)?),
        };
        let kvbm = match &config.kvbm {
            None => None,
            Some(_) => Some((
                kvgate("kvgate-kvbm")?,
                on_path(&config.redis_server).ok_or_else(|| StackError::MissingBinary {
                    name: "redis-server".into(),
                    path: config.redis_server.clone(),
                    hint: "install it (Debian: apt-get install redis-server)".into(),
                })?,
            )),
        };
        Ok(Binaries {
            sim: kvgate("kvgate-sim")?,
            sidecar: kvgate("kvgate-sidecar")?,
            epp: kvgate("kvgate-epp")?,
            envoy,
            nats: on_path(&config.nats_server).ok_or_else(|| StackError::MissingBinary {
                name: "nats-server".into(),
                path: config.nats_server.clone(),
                hint: "install it (Debian: apt-get install nats-server)".into(),
            })?,
            router,
            kvbm,
        })
    }
}

/// The running executable's directory; a test binary in `target/<profile>/deps` maps to
/// `target/<profile>`, where cargo puts the workspace's binaries.
pub(crate) fn exe_dir() -> Result<PathBuf, StackError> {
    let exe = std::env::current_exe().map_err(|source| StackError::Io {
        what: "locating the running executable".into(),
        source,
    })?;
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok(if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().map(Path::to_path_buf).unwrap_or(dir)
    } else {
        dir
    })
}

pub(crate) fn existing(name: &str, path: PathBuf, hint: &str) -> Result<PathBuf, StackError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(StackError::MissingBinary {
            name: name.into(),
            path,
            hint: hint.into(),
        })
    }
}

/// `$KVGATE_ENVOY`, else `<workspace>/.venv/lib/python3*/site-packages/envoy/_bin/envoy`.
pub(crate) fn venv_envoy() -> Result<PathBuf, StackError> {
    if let Some(p) = std::env::var_os("KVGATE_ENVOY") {
        return existing("envoy", PathBuf::from(p), "KVGATE_ENVOY names no file");
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|entries| {
        entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.is_file())
    });
    found.ok_or_else(|| StackError::MissingBinary {
        name: "envoy".into(),
        path: lib.join("python3*/site-packages/envoy/_bin/envoy"),
        hint: "run scripts/bootstrap.sh (it installs Envoy into .venv), or set KVGATE_ENVOY".into(),
    })
}

/// A peer router from `<workspace>/.venv/bin`, `$KVGATE_ROUTERS_VENV/bin` or the `PATH`.
pub(crate) fn peer_router(router: Router) -> Result<PathBuf, StackError> {
    let name = router.program();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin")];
    if let Some(v) = std::env::var_os("KVGATE_ROUTERS_VENV") {
        dirs.push(PathBuf::from(v).join("bin"));
    }
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .or_else(|| on_path(Path::new(name)))
        .ok_or_else(|| StackError::MissingBinary {
            name: name.into(),
            path: PathBuf::from(name),
            hint: format!(
                "install it from PyPI into a venv (python3 -m venv v && v/bin/pip install {name}) \
                 and set KVGATE_ROUTERS_VENV=v, or pass --router-bin"
            ),
        })
}

/// `program` itself when it has a directory part, else the first match on `PATH` or in
/// `/usr/sbin` and `/usr/local/sbin` (Debian's nats-server lives in /usr/sbin).
pub(crate) fn on_path(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use super::*;

    #[test]
    fn a_missing_bin_dir_names_the_binary_and_the_build_command() {
        let config = StackConfig {
            bin_dir: Some(PathBuf::from("/nonexistent/kvgate")),
            ..StackConfig::default()
        };
        let err = Binaries::locate(&config).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/kvgate/kvgate-"), "{err}");
        assert!(err.contains("cargo build"), "{err}");
    }

    #[test]
    fn path_lookup_finds_sh_and_not_nonsense() {
        assert!(on_path(Path::new("sh")).is_some());
        assert!(on_path(Path::new("kvgate-no-such-program")).is_none());
        assert_eq!(
            on_path(Path::new("/bin/sh")),
            Some(PathBuf::from("/bin/sh"))
        );
    }
}
