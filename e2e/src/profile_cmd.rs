//! `kvgate-bench profile`: measures a replica's performance profile (prefill TTFT against load;
//! decode throughput against ITL and context) on the engine model in virtual time
//! (`replay::profiler`) and writes it as a Kubernetes ConfigMap whose key [`PROFILE_KEY`]
//! holds the profile as YAML — what a `PoolAutoscaler`'s `profile.configMapName` (and `key`,
//! which defaults to the same name) points at.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use engine_model::Preset;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use planner::Profile;
use replay::profiler::{ProfileOptions, ProfilerError, measure};

/// The ConfigMap key holding the profile (the CRD's `profile.key` default).
pub const PROFILE_KEY: &str = "profile.yaml";

/// `kvgate-bench profile` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArgs {
    /// Engine preset (`h200-llama70b-fp8`, `h100x4-llama70b-tp4`, `small`).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    pub preset: Preset,
    /// Prompt lengths of the prefill curve, tokens (comma-separated; each request draws one):
    /// the workload's distribution, since TTFT at a percentile depends on it.
    #[arg(long, value_delimiter = ',', default_value = "8192")]
    pub prompt_tokens: Vec<u32>,
    /// Draw the prompt lengths from this Mooncake trace instead (cut at
    /// `--max-prompt-tokens`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Longest prompt drawn from `--trace`, tokens.
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: u32,
    /// The percentile TTFT is measured at, in percent (the SLO's).
    #[arg(long, default_value_t = 90.0)]
    pub percentile: f64,
    /// Prefill loads as fractions of the engine's saturated prefill rate (comma-separated,
    /// increasing).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.85,0.9,0.95,1.0"
    )]
    pub loads: Vec<f64>,
    /// Requests per prefill load (over the pool).
    #[arg(long, default_value_t = 4000)]
    pub requests_per_load: u64,
    /// Prefill engines measured together (a replica's TTFT depends on the pool it shares the
    /// load with; use about the size it will serve in).
    #[arg(long, default_value_t = 8)]
    pub pool: usize,
    /// Decode context lengths, tokens.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384,32768"
    )]
    pub contexts: Vec<u32>,
    /// Decode batch sizes (those above the engine's `max_num_seqs` are skipped).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,24,32,48,64,96,128,192,256"
    )]
    pub batches: Vec<u32>,
    /// Points on the ITL axis of the decode table.
    #[arg(long, default_value_t = 24)]
    pub itl_points: usize,
    /// Output tokens per decode request.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: u32,
    /// Seeds the arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The ConfigMap's name.
    #[arg(long, default_value = "kvgate-profile")]
    pub name: String,
    /// The ConfigMap's namespace (none: the one `kubectl apply` uses).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Where to write the ConfigMap (`-`: stdout).
    #[arg(long, default_value = "profile-configmap.yaml")]
    pub out: PathBuf,
}

/// Why `kvgate-bench profile` failed.
#[derive(Debug, thiserror::Error)]
pub enum ProfileCmdError {
    /// The measurement failed or its options are out of range.
    #[error("profile")]
    Profiler(#[from] ProfilerError),
    /// The ConfigMap could not be written as YAML.
    #[error("writing the ConfigMap as YAML")]
    Yaml(#[from] serde_yaml_ng::Error),
    /// The trace.
    #[error("trace")]
    Trace(#[from] workload::MooncakeError),
    /// The output file.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl ProfileCmdError {
    /// Whether the options were at fault (exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(self, Self::Profiler(ProfilerError::Options(_)))
    }
}

impl ProfileArgs {
    /// The profiler's options, prompt lengths from `--trace` if given.
    pub fn options(&self) -> Result<ProfileOptions, ProfileCmdError> {
        let prompt_tokens = match &self.trace {
            None => self.prompt_tokens.clone(),
            Some(path) => {
                let file = std::fs::File::open(path).map_err(|source| ProfileCmdError::Io {
                    path: path.clone(),
                    source,
                })?;
                let trace = workload::read_mooncake(
                    std::io::BufReader::new(file),
                    &workload::MooncakeOptions::default(),
                )?;
                trace
                    .sessions
                    .iter()
                    .filter_map(|s| s.turns.first())
                    .map(|t| {
                        let len: u32 = t.user.iter().map(|s| s.len).sum();
                        len.clamp(1, self.max_prompt_tokens.max(1))
                    })
                    .collect()
            }
        };
        Ok(ProfileOptions {
            engine: self.preset.config(),
            prompt_tokens,
            percentile: self.percentile,
            loads: self.loads.clone(),
            requests_per_load: self.requests_per_load,
            pool: self.pool,
            contexts: self.contexts.clone(),
            batches: self.batches.clone(),
            itl_points: self.itl_points,
            decode_tokens: self.decode_tokens,
            seed: self.seed,
        })
    }
}

/// `profile` as a ConfigMap named `name` (in `namespace`), YAML.
pub fn config_map(
    profile: &Profile,
    name: &str,
    namespace: Option<&str>,
) -> Result<String, serde_yaml_ng::Error> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: namespace.map(str::to_owned),
            labels: Some([("app.kubernetes.io/part-of".to_owned(), "kvgate".to_owned())].into()),
            ..ObjectMeta::default()
        },
        data: Some([(PROFILE_KEY.to_owned(), serde_yaml_ng::to_string(profile)?)].into()),
        ..ConfigMap::default()
    };
    serde_yaml_ng::to_string(&cm)
}

/// The profile a ConfigMap written by [`config_map`] holds (or a bare profile YAML).
pub fn read_profile(text: &str) -> Result<Profile, serde_yaml_ng::Error> {
    if let Ok(cm) = serde_yaml_ng::from_str::<ConfigMap>(text)
        && let Some(inner) = cm.data.as_ref().and_then(|d| d.get(PROFILE_KEY))
    {
        return serde_yaml_ng::from_str(inner);
    }
    serde_yaml_ng::from_str(text)
}

fn write(path: &Path, text: &str) -> Result<(), ProfileCmdError> {
    let io = |source| ProfileCmdError::Io {
        path: path.to_owned(),
        source,
    };
    if path == Path::new("-") {
        std::io::stdout()
            .lock()
            .write_all(text.as_bytes())
            .map_err(io)
    } else {
        std::fs::write(path, text).map_err(io)
    }
}

/// Measures the profile and writes the ConfigMap.
pub fn run(args: &ProfileArgs) -> Result<(), ProfileCmdError> {
    let profile = measure(&args.options()?)?;
    let yaml = config_map(&profile, &args.name, args.namespace.as_deref())?;
    write(&args.out, &yaml)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use clap::Parser as _;

    fn args(extra: &[&str]) -> ProfileArgs {
        let mut argv = vec!["kvgate-bench", "profile"];
        argv.extend_from_slice(extra);
        match crate::bench::Args::parse_from(argv).command {
            crate::bench::Command::Profile(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn writes_a_config_map_whose_key_reads_back_as_the_profile() {
        let dir = std::env::temp_dir().join(format!("kvgate-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("cm.yaml");
        let mut a = args(&[
            "--preset",
            "small",
            "--prompt-tokens",
            "1024",
            "--loads",
            "0.3,0.9",
            "--requests-per-load",
            "20",
            "--contexts",
            "1024,2048",
            "--batches",
            "1,16",
            "--decode-tokens",
            "8",
            "--name",
            "llama-profile",
            "--namespace",
            "llm",
        ]);
        a.out = out.clone();
        run(&a).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        let cm: ConfigMap = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(cm.metadata.name.as_deref(), Some("llama-profile"));
        assert_eq!(cm.metadata.namespace.as_deref(), Some("llm"));
        assert!(text.contains("kind: ConfigMap"), "{text}");
        let profile = read_profile(&text).unwrap();
        profile.validate().unwrap();
        assert_eq!(profile.prefill.len(), 2);
        assert_eq!(profile.decode.context_tokens, vec![1024.0, 2048.0]);
        let bare = serde_yaml_ng::to_string(&profile).unwrap();
        assert_eq!(read_profile(&bare).unwrap(), profile);
        std::fs::remove_dir_all(&dir).unwrap();
        let bad = args(&["--loads", "0.5,0.1"]);
        assert!(measure(&bad.options().unwrap()).is_err());
        let lengths = args(&["--prompt-tokens", "100,200"]).options().unwrap();
        assert_eq!(lengths.prompt_tokens, vec![100, 200]);
    }
}
