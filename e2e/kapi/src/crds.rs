//! Installing CustomResourceDefinitions and waiting until the server serves them.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

use crate::KapiError;

/// The kvgate test copies of the upstream CRDs (`e2e/crds`).
pub fn test_copies_dir() -> std::path::PathBuf {
    crate::tools::workspace_root().join("e2e/crds")
}

/// kvgate's own CRDs (the chart's `crds/`).
pub fn owned_dir() -> std::path::PathBuf {
    crate::tools::workspace_root().join("charts/kvgate/crds")
}

/// Server-side applies every CRD in the YAML files of `dir` whose file name passes `keep`, and
/// waits until each is `Established`. Returns the CRD names.
pub async fn install_dir(
    client: &kube::Client,
    dir: &Path,
    keep: impl Fn(&str) -> bool,
) -> Result<Vec<String>, KapiError> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| KapiError::io(format!("read {}", dir.display()), e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "yaml")
                && p.file_name().and_then(|n| n.to_str()).is_some_and(&keep)
        })
        .collect();
    files.sort();
    let mut names = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| KapiError::io(format!("read {}", file.display()), e))?;
        names.push(install(client, &text).await?);
    }
    Ok(names)
}

/// Server-side applies one CRD (YAML) and waits until it is `Established`.
pub async fn install(client: &kube::Client, yaml: &str) -> Result<String, KapiError> {
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(yaml)
        .map_err(|e| KapiError::io("parse a CRD", std::io::Error::other(e)))?;
    let name = crd.metadata.name.clone().unwrap_or_default();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply("kvgate-tests").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    for _ in 0..200 {
        let current = api.get_status(&name).await?;
        let established = current
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return Ok(name);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(KapiError::io(
        format!("CRD {name}"),
        std::io::Error::other("not Established within 10 s"),
    ))
}
