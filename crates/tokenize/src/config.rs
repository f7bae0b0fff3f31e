//! Reading a Hugging Face tokenizer directory's `tokenizer_config.json` (special tokens, chat
//! templates) and the newer `chat_template.jinja` / `additional_chat_templates/*.jinja` files,
//! which take priority over the templates in the config, as `transformers` loads them.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::LoadError;

/// `tokenizer_config.json`'s file name.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The single-template file of newer checkpoints.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The folder of named templates of newer checkpoints.
pub const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";

/// The named special tokens `transformers` passes to every chat template (its `special_tokens_map`).
pub(crate) const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One chat template and where it came from.
#[derive(Clone, Debug)]
pub(crate) struct TemplateSource {
    pub(crate) name: String,
    pub(crate) source: String,
    pub(crate) file: PathBuf,
}

/// What kvgate uses from the config files.
#[derive(Clone, Debug, Default)]
pub(crate) struct TokenizerConfig {
    /// `(name, content)` of every special token that is set, in [`SPECIAL_TOKEN_NAMES`] order.
    pub(crate) special_tokens: Vec<(&'static str, String)>,
    /// Chat templates by name (`default`, `tool_use`, …).
    pub(crate) templates: Vec<TemplateSource>,
    /// `clean_up_tokenization_spaces`, applied by `decode`.
    pub(crate) clean_up_tokenization_spaces: bool,
}

impl TokenizerConfig {
    /// The content of a special token (`"eos_token"`, …), if set.
    pub(crate) fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

fn read_to_string(file: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(file).map_err(|source| LoadError::Read {
        file: file.to_owned(),
        source,
    })
}

/// Reads the config and template files of `dir`.
pub(crate) fn load(dir: &Path) -> Result<TokenizerConfig, LoadError> {
    let file = dir.join(TOKENIZER_CONFIG_FILE);
    let text = read_to_string(&file)?;
    let mut config = parse(&text, &file)?;
    let files = template_files(dir)?;
    if !files.is_empty() {
        config.templates = files;
    }
    Ok(config)
}

/// Parses `tokenizer_config.json` text; `file` is only used in errors.
pub(crate) fn parse(text: &str, file: &Path) -> Result<TokenizerConfig, LoadError> {
    let json: Value = serde_json::from_str(text).map_err(|source| LoadError::Json {
        file: file.to_owned(),
        source,
    })?;
    let Value::Object(obj) = json else {
        return Err(field_error(file, "(root)", "not a JSON object"));
    };
    let mut config = TokenizerConfig::default();
    for name in SPECIAL_TOKEN_NAMES {
        if let Some(content) = special_token(obj.get(name), file, name)? {
            config.special_tokens.push((name, content));
        }
    }
    config.templates = match obj.get("chat_template") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(source)) => vec![TemplateSource {
            name: "default".to_owned(),
            source: source.clone(),
            file: file.to_owned(),
        }],
        Some(Value::Array(list)) => list
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Value::as_str);
                let source = item.get("template").and_then(Value::as_str);
                match (name, source) {
                    (Some(name), Some(source)) => Ok(TemplateSource {
                        name: name.to_owned(),
                        source: source.to_owned(),
                        file: file.to_owned(),
                    }),
                    _ => Err(field_error(
                        file,
                        "chat_template",
                        "list items must be {\"name\": string, \"template\": string}",
                    )),
                }
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(field_error(
                file,
                "chat_template",
                "must be a string or a list of named templates",
            ));
        }
    };
    config.clean_up_tokenization_spaces = match obj.get("clean_up_tokenization_spaces") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(field_error(
                file,
                "clean_up_tokenization_spaces",
                "must be a boolean",
            ));
        }
    };
    Ok(config)
}

/// A special token given as a string or as an `AddedToken` object `{"content": …}`.
fn special_token(
    value: Option<&Value>,
    file: &Path,
    name: &'static str,
) -> Result<Option<String>, LoadError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(file, name, "object without a string `content`")),
        },
        Some(_) => Err(field_error(
            file,
            name,
            "must be a string or {\"content\": string}",
        )),
    }
}

fn field_error(file: &Path, field: &'static str, reason: &str) -> LoadError {
    LoadError::Field {
        file: file.to_owned(),
        field,
        reason: reason.to_owned(),
    }
}

/// `chat_template.jinja` (as `default`) and `additional_chat_templates/<name>.jinja`, sorted by name.
fn template_files(dir: &Path) -> Result<Vec<TemplateSource>, LoadError> {
    let mut out = Vec::new();
    let single = dir.join(CHAT_TEMPLATE_FILE);
    if single.is_file() {
        out.push(TemplateSource {
            name: "default".to_owned(),
            source: read_to_string(&single)?,
            file: single,
        });
    }
    let extra = dir.join(CHAT_TEMPLATE_DIR);
    if extra.is_dir() {
        let entries = std::fs::read_dir(&extra).map_err(|source| LoadError::Read {
            file: extra.clone(),
            source,
        })?;
        let mut named = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| LoadError::Read {
                file: extra.clone(),
                source,
            })?;
            let path = entry.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jinja"))
            else {
                continue;
            };
            named.push(TemplateSource {
                name: name.to_owned(),
                source: read_to_string(&path)?,
                file: path.clone(),
            });
        }
        named.sort_by(|a, b| a.name.cmp(&b.name));
        for t in named {
            out.retain(|o: &TemplateSource| o.name != t.name);
            out.push(t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_and_special_tokens_in_both_forms() {
        let text = r#"{
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "pad_token": null,
            "chat_template": [
                {"name": "default", "template": "{{ bos_token }}"},
                {"name": "tool_use", "template": "{{ tools }}"}
            ]
        }"#;
        let c = parse(text, Path::new("tokenizer_config.json")).unwrap();
        assert_eq!(c.special_token("bos_token"), Some("<s>"));
        assert_eq!(c.special_token("eos_token"), Some("</s>"));
        assert_eq!(c.special_token("pad_token"), None);
        let names: Vec<_> = c.templates.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["default", "tool_use"]);

        let c = parse(r#"{"chat_template": "x"}"#, Path::new("c.json")).unwrap();
        assert_eq!(c.templates.len(), 1);
        assert_eq!(c.templates[0].source, "x");
    }

    #[test]
    fn bad_fields_name_the_file_and_field() {
        let err = parse(
            r#"{"chat_template": 3}"#,
            Path::new("/m/tokenizer_config.json"),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("/m/tokenizer_config.json") && msg.contains("chat_template"),
            "{msg}"
        );
        let err = parse(r#"{"eos_token": 3}"#, Path::new("c.json")).unwrap_err();
        assert!(matches!(
            err,
            LoadError::Field {
                field: "eos_token",
                ..
            }
        ));
        let err = parse("{", Path::new("c.json")).unwrap_err();
        assert!(matches!(err, LoadError::Json { .. }));
    }
}
