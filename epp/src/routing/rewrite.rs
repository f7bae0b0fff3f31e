//! Model-name rewriting, both directions (GIE's `InferenceModelRewrite` semantics).
//!
//! Request side: the model a request names may be served under another name (a LoRA adapter, a
//! canary). The target is the header `x-gateway-model-name-rewrite` (or
//! `x-llm-d-model-name-rewrite`) when present, else a weighted choice among the first rule
//! whose match equals the model, else no rewrite. The body's `model` is replaced and the body
//! re-serialised (key order kept); block keys are computed for the target, since the engine
//! caches under the name it serves.
//!
//! Response side: the client must see the name it asked for, so `"model":"<target>"` (with or
//! without a space after the colon) is replaced by `"model":"<client>"` in the response body,
//! also when an occurrence straddles two chunks of a streamed response (the ext_proc layer's
//! `ResponseRewriter`, driven by [`crate::extproc::Decision::response_model`]).

use serde::Deserialize;
use serde_json::Value;

/// Headers naming the target model for one request (GIE and llm-d spellings).
pub const REWRITE_HEADERS: [&str; 2] =
    ["x-gateway-model-name-rewrite", "x-llm-d-model-name-rewrite"];

/// Most rules and targets a rule file may hold.
const MAX_RULES: usize = 1024;
const MAX_TARGETS: usize = 64;

/// One weighted target of a rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Target {
    /// The model name the engine serves.
    pub model_rewrite: String,
    /// Relative weight (default 1; 0 never chosen).
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

/// Requests for `model` go to one of `targets`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Rule {
    /// The model name clients use (exact match).
    pub model: String,
    /// Where they go.
    pub targets: Vec<Target>,
}

/// The rule file: `rules: [{model, targets: [{modelRewrite, weight}]}]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewriteRules {
    /// Rules, first match wins.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// Why a rule file or a rewrite was refused.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    /// The YAML is malformed or has unknown fields.
    #[error("model rewrite rules: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
    /// A rule is unusable.
    #[error("model rewrite rule {index} (model {model:?}): {why}")]
    Invalid {
        /// Position in the file.
        index: usize,
        /// Its model.
        model: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The file exceeds a bound.
    #[error("model rewrite rules: more than {MAX_RULES} rules")]
    TooMany,
    /// The body could not be re-serialised with the new model.
    #[error("request body cannot carry a rewritten model: {0}")]
    Body(String),
}

impl RewriteRules {
    /// Parses and validates a rule file.
    pub fn from_yaml(text: &str) -> Result<Self, RewriteError> {
        let rules: RewriteRules = serde_yaml_ng::from_str(text)?;
        if rules.rules.len() > MAX_RULES {
            return Err(RewriteError::TooMany);
        }
        for (index, r) in rules.rules.iter().enumerate() {
            let invalid = |why| RewriteError::Invalid {
                index,
                model: r.model.clone(),
                why,
            };
            if r.model.is_empty() {
                return Err(invalid("empty model"));
            }
            if r.targets.is_empty() || r.targets.len() > MAX_TARGETS {
                return Err(invalid("needs 1 to 64 targets"));
            }
            if r.targets.iter().any(|t| t.model_rewrite.is_empty()) {
                return Err(invalid("empty modelRewrite"));
            }
            if r.targets.iter().all(|t| t.weight == 0) {
                return Err(invalid("all target weights are 0"));
            }
        }
        Ok(rules)
    }

    /// The target for a request for `model`, given the request's rewrite header (if any) and a
    /// uniformly random `draw`. `None` when the model stays as it is.
    pub fn target<'a>(
        &'a self,
        model: &str,
        header: Option<&'a str>,
        draw: u64,
    ) -> Option<&'a str> {
        if let Some(h) = header.map(str::trim).filter(|h| !h.is_empty()) {
            return (h != model).then_some(h);
        }
        let rule = self.rules.iter().find(|r| r.model == model)?;
        let total: u64 = rule.targets.iter().map(|t| u64::from(t.weight)).sum();
        let mut point = draw % total.max(1);
        for t in &rule.targets {
            let w = u64::from(t.weight);
            if point < w {
                return (t.model_rewrite != model).then_some(t.model_rewrite.as_str());
            }
            point -= w;
        }
        None
    }
}

/// `body` with its top-level `model` set to `target` (other fields and their order kept).
pub fn rewrite_request_body(body: &[u8], target: &str) -> Result<Vec<u8>, RewriteError> {
    let mut v: Value =
        serde_json::from_slice(body).map_err(|e| RewriteError::Body(e.to_string()))?;
    let Some(obj) = v.as_object_mut() else {
        return Err(RewriteError::Body("not a JSON object".into()));
    };
    obj.insert("model".to_owned(), Value::String(target.to_owned()));
    serde_json::to_vec(&v).map_err(|e| RewriteError::Body(e.to_string()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    const RULES: &str = "
rules:
  - model: llama
    targets:
      - modelRewrite: llama-lora-a
        weight: 3
      - modelRewrite: llama-lora-b
        weight: 1
  - model: fixed
    targets:
      - modelRewrite: fixed-v2
";

    #[test]
    fn header_beats_rules_and_weights_split_the_draws() {
        let r = RewriteRules::from_yaml(RULES).unwrap();
        assert_eq!(r.target("llama", Some("forced"), 0), Some("forced"));
        assert_eq!(r.target("llama", Some("llama"), 0), None);
        assert_eq!(r.target("other", None, 0), None);
        assert_eq!(r.target("fixed", None, 12345), Some("fixed-v2"));
        let a = (0..400u64)
            .filter(|d| r.target("llama", None, *d) == Some("llama-lora-a"))
            .count();
        assert_eq!(a, 300);
    }

    #[test]
    fn refuses_bad_rule_files() {
        for bad in [
            "rules: [{model: '', targets: [{modelRewrite: x}]}]",
            "rules: [{model: m, targets: []}]",
            "rules: [{model: m, targets: [{modelRewrite: x, weight: 0}]}]",
            "rules: [{model: m, targets: [{modelRewrite: ''}]}]",
            "rules: [{model: m, target: [{modelRewrite: x}]}]",
            "rulez: []",
        ] {
            assert!(RewriteRules::from_yaml(bad).is_err(), "{bad}");
        }
        assert_eq!(
            RewriteRules::from_yaml("{}").unwrap(),
            RewriteRules::default()
        );
    }

    #[test]
    fn request_body_keeps_other_fields_in_order() {
        let body = br#"{"model":"a","prompt":"hi \"x\"","max_tokens":3}"#;
        let out = rewrite_request_body(body, "b").unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"b","prompt":"hi \"x\"","max_tokens":3}"#
        );
        let added = rewrite_request_body(br#"{"prompt":"p"}"#, "b").unwrap();
        assert_eq!(added, br#"{"prompt":"p","model":"b"}"#);
        assert!(rewrite_request_body(b"[1]", "b").is_err());
        assert!(rewrite_request_body(b"{", "b").is_err());
    }
}
