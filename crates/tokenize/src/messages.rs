//! OpenAI chat messages and tools, normalized the way vLLM's OpenAI server prepares them for a
//! chat template (vLLM 0.32: the request model's validators, `_parse_chat_message_content`,
//! `_postprocess_messages`, the developer-role fallback, and the tool models' serializers).
//!
//! - `reasoning_content` is renamed `reasoning`; an assistant message carries it as both.
//! - Content becomes a string (text parts joined with `"\n"`, empty parts dropped) for templates
//!   that print `message.content`, or a list of `{"type": "text", "text": …}` parts for templates
//!   that loop over it ([`ContentFormat`]). Image, audio and video parts are refused.
//! - Only `role`, `content`, `tool_calls`, `reasoning`, `reasoning_content`, `tool_call_id`,
//!   `name`, `task` and (developer) `tools` survive; other fields are dropped, as vLLM drops them.
//! - Tool-call `arguments` given as a JSON string become an object (`{}` when not an object).
//! - Developer messages become system messages when the template never names the developer
//!   role, and system messages are then merged into one at the front.

use serde_json::{Map, Value};

use crate::error::{Result, TokenizeError};

/// A message after normalization.
pub(crate) type Message = Map<String, Value>;

/// How a chat template expects `message.content`: vLLM's `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: text parts joined with `"\n"`.
    #[default]
    String,
    /// A list of parts `{"type": "text", "text": …}`.
    OpenAi,
}

/// The line vLLM removes from system prompts (Claude Code's per-request billing header).
const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";

fn invalid(index: usize, reason: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidMessage {
        index,
        reason: reason.into(),
    }
}

fn unsupported(index: usize, part_type: &str) -> TokenizeError {
    TokenizeError::UnsupportedContent {
        index,
        part_type: part_type.to_owned(),
    }
}

/// Content part types whose payload is an image, audio, video or embedding.
const MEDIA_TYPES: [&str; 9] = [
    "image_url",
    "input_image",
    "image_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "prompt_embeds",
];

/// One parsed content part: its text (or tool-reference name) and whether it is a tool reference.
enum Part<'a> {
    Text(&'a str),
    ToolReference(&'a str),
}

/// Parses one content part as vLLM does for a text-only model; `None` for a part that is skipped.
fn parse_part(index: usize, part: &Value) -> Result<Option<Part<'_>>> {
    let obj = match part {
        Value::String(s) => return Ok(Some(Part::Text(s))),
        Value::Object(obj) => obj,
        _ => return Err(invalid(index, "content parts must be strings or objects")),
    };
    let part_type = obj.get("type");
    let has_uuid = obj.get("uuid").is_some_and(|u| !u.is_null());
    let text_field = |key: &str| -> Result<Option<Part<'_>>> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(Part::Text(s))),
            Some(_) => Err(invalid(
                index,
                format!("content part `{key}` must be a string"),
            )),
        }
    };
    match part_type {
        Some(Value::String(t)) if !has_uuid => match t.as_str() {
            "text" | "input_text" | "output_text" => text_field("text"),
            "thinking" => text_field("thinking"),
            "refusal" => text_field("refusal"),
            "tool_reference" => Ok(text_field("name")?.map(|p| match p {
                Part::Text(s) | Part::ToolReference(s) => Part::ToolReference(s),
            })),
            other => Err(unsupported(index, other)),
        },
        None | Some(Value::Null) | Some(Value::String(_)) => {
            if let Some(media) = MEDIA_TYPES.iter().find(|k| {
                obj.get(**k)
                    .is_some_and(|v| **k != "input_audio" || !v.is_null())
            }) {
                return Err(unsupported(index, media));
            }
            if obj.contains_key("tool_reference") {
                return Ok(text_field("tool_reference")?.map(|p| match p {
                    Part::Text(s) | Part::ToolReference(s) => Part::ToolReference(s),
                }));
            }
            Err(invalid(index, "content part without a `type`"))
        }
        Some(_) => Err(invalid(index, "content part `type` must be a string")),
    }
}

/// Drops Claude Code's billing-header line from system text parts, as vLLM does.
fn strip_billing_header(parts: Vec<Part<'_>>) -> Vec<Part<'_>> {
    parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Text(s) if s.starts_with(CLAUDE_CODE_BILLING_HEADER) => {
                let rest = s.split_once('\n').map(|(_, r)| r).unwrap_or("");
                (!rest.is_empty()).then_some(Part::Text(rest))
            }
            p => Some(p),
        })
        .collect()
}

/// The content of message `index` in `format`.
fn parse_content(
    index: usize,
    role: &str,
    content: Option<&Value>,
    format: ContentFormat,
) -> Result<Value> {
    let parts: Vec<Part<'_>> = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![Part::Text(s)],
        Some(Value::Array(items)) => items
            .iter()
            .map(|p| parse_part(index, p))
            .filter_map(Result::transpose)
            .collect::<Result<_>>()?,
        Some(_) => return Err(invalid(index, "`content` must be a string, a list or null")),
    };
    let parts = if role == "system" {
        strip_billing_header(parts)
    } else {
        parts
    };
    // vLLM keeps only truthy parts: empty strings vanish.
    let parts = parts.into_iter().filter(|p| match p {
        Part::Text(s) | Part::ToolReference(s) => !s.is_empty(),
    });
    Ok(match format {
        ContentFormat::String => {
            let texts: Vec<&str> = parts
                .map(|p| match p {
                    Part::Text(s) | Part::ToolReference(s) => s,
                })
                .collect();
            Value::String(texts.join("\n"))
        }
        ContentFormat::OpenAi => Value::Array(
            parts
                .map(|p| {
                    let mut m = Map::new();
                    match p {
                        Part::Text(s) => {
                            m.insert("type".into(), "text".into());
                            m.insert("text".into(), s.into());
                        }
                        Part::ToolReference(s) => {
                            m.insert("type".into(), "tool_reference".into());
                            m.insert("name".into(), s.into());
                        }
                    }
                    Value::Object(m)
                })
                .collect(),
        ),
    })
}

/// Tool-call arguments as vLLM hands them to templates: always an object.
fn normalize_arguments(arguments: Option<&Value>) -> Value {
    let parsed = match arguments {
        Some(Value::Object(o)) if !o.is_empty() => return Value::Object(o.clone()),
        Some(Value::String(s)) if !s.is_empty() => serde_json::from_str::<Value>(s).ok(),
        _ => None,
    };
    match parsed {
        Some(Value::Object(o)) => Value::Object(o),
        _ => Value::Object(Map::new()),
    }
}

/// `tool_calls` of an assistant message: objects of type `function`, arguments as objects.
/// `None` drops the field (absent, null, or empty).
fn normalize_tool_calls(index: usize, tool_calls: &Value) -> Result<Option<Value>> {
    let Value::Array(calls) = tool_calls else {
        return Err(invalid(index, "`tool_calls` must be a list"));
    };
    if calls.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let Value::Object(call) = call else {
            return Err(invalid(
                index,
                "assistant tool_calls entries must be objects",
            ));
        };
        let is_function = match call.get("type") {
            None => true,
            Some(Value::String(t)) => t == "function",
            Some(_) => false,
        };
        let Some(Value::Object(function)) = call.get("function").filter(|_| is_function) else {
            return Err(invalid(
                index,
                "chat completions only support assistant tool_calls of type 'function'",
            ));
        };
        let mut function = function.clone();
        let args = normalize_arguments(function.get("arguments"));
        function.insert("arguments".to_owned(), args);
        let mut call = call.clone();
        call.insert("function".to_owned(), Value::Object(function));
        out.push(Value::Object(call));
    }
    Ok(Some(Value::Array(out)))
}

/// Normalizes `messages` for a template that takes `format` content and knows (or not) the
/// developer role.
pub(crate) fn normalize(
    messages: &[Value],
    format: ContentFormat,
    supports_developer: bool,
) -> Result<Vec<Message>> {
    let mut out = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        out.push(normalize_one(index, message, format)?);
    }
    let has_developer = out
        .iter()
        .any(|m| m.get("role").and_then(Value::as_str) == Some("developer"));
    if has_developer && !supports_developer {
        for m in &mut out {
            if m.get("role").and_then(Value::as_str) == Some("developer") {
                m.insert("role".to_owned(), "system".into());
                m.shift_remove("tools");
            }
        }
        out = consolidate_system_messages(out);
    }
    Ok(out)
}

fn normalize_one(index: usize, message: &Value, format: ContentFormat) -> Result<Message> {
    let Value::Object(msg) = message else {
        return Err(invalid(index, "a message must be an object"));
    };
    let Some(Value::String(role)) = msg.get("role") else {
        return Err(invalid(index, "a message needs a string `role`"));
    };
    let string_or_null = |key: &str| -> Result<Option<&String>> {
        match msg.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(invalid(index, format!("`{key}` must be a string or null"))),
        }
    };
    let reasoning = match string_or_null("reasoning")? {
        Some(r) => Some(r),
        None => string_or_null("reasoning_content")?,
    };

    let mut content = parse_content(index, role, msg.get("content"), format)?;
    // vLLM flattens all-text part lists of tool messages to a string.
    if let ("tool", Value::Array(parts)) = (role.as_str(), &content) {
        let all_text = parts
            .iter()
            .all(|p| p.get("type").and_then(Value::as_str) == Some("text"));
        if all_text {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            content = Value::String(texts.join("\n"));
        }
    }

    let mut out = Map::new();
    out.insert("role".to_owned(), Value::String(role.clone()));
    out.insert("content".to_owned(), content);
    match role.as_str() {
        "assistant" => {
            if let Some(calls) = msg.get("tool_calls").filter(|v| !v.is_null())
                && let Some(calls) = normalize_tool_calls(index, calls)?
            {
                out.insert("tool_calls".to_owned(), calls);
            }
            if let Some(r) = reasoning {
                out.insert("reasoning".to_owned(), Value::String(r.clone()));
                out.insert("reasoning_content".to_owned(), Value::String(r.clone()));
            }
        }
        "tool" => {
            if let Some(id) = msg.get("tool_call_id") {
                out.insert("tool_call_id".to_owned(), id.clone());
            }
        }
        _ => {}
    }
    if let Some(Value::String(name)) = msg.get("name") {
        out.insert("name".to_owned(), Value::String(name.clone()));
    }
    if let Some(Value::String(task)) = msg.get("task") {
        out.insert("task".to_owned(), Value::String(task.clone()));
    }
    if role == "developer" {
        out.insert(
            "tools".to_owned(),
            msg.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(out)
}

/// Merges every system message into one at the front (contents joined with a blank line), when
/// there is more than one or one not at the front.
fn consolidate_system_messages(messages: Vec<Message>) -> Vec<Message> {
    let is_system = |m: &Message| m.get("role").and_then(Value::as_str) == Some("system");
    let systems = messages.iter().filter(|m| is_system(m)).count();
    let first_is_system = messages.first().is_some_and(is_system);
    if systems == 0 || (systems == 1 && first_is_system) {
        return messages;
    }
    let mut contents = Vec::new();
    let mut rest = Vec::with_capacity(messages.len());
    for m in messages {
        if !is_system(&m) {
            rest.push(m);
            continue;
        }
        let text = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| match p {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(o) => o.get("text").and_then(Value::as_str),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            contents.push(text);
        }
    }
    let mut merged = Map::new();
    merged.insert("role".to_owned(), "system".into());
    merged.insert("content".to_owned(), Value::String(contents.join("\n\n")));
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(merged);
    out.extend(rest);
    out
}

/// `tools` as vLLM dumps its tool models: `{"type": "function", "function": {"name",
/// "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}`, with
/// missing descriptions and parameters as `null` and unknown fields dropped.
pub(crate) fn normalize_tools(tools: &Value) -> Result<Value> {
    let bad = |reason: &str| TokenizeError::InvalidTools {
        reason: reason.to_owned(),
    };
    let Value::Array(items) = tools else {
        return Err(bad("must be a list"));
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Object(item) = item else {
            return Err(bad("each tool must be an object"));
        };
        match item.get("type") {
            None => {}
            Some(Value::String(t)) if t == "function" => {}
            Some(_) => return Err(bad("tool `type` must be \"function\"")),
        }
        let Some(Value::Object(function)) = item.get("function") else {
            return Err(bad("each tool needs a `function` object"));
        };
        let Some(Value::String(name)) = function.get("name") else {
            return Err(bad("each function needs a string `name`"));
        };
        let nullable = |key: &str, ok: fn(&Value) -> bool| -> Result<Value> {
            match function.get(key) {
                None => Ok(Value::Null),
                Some(v) if v.is_null() || ok(v) => Ok(v.clone()),
                Some(_) => Err(bad(&format!("function `{key}` has the wrong type"))),
            }
        };
        let description = nullable("description", Value::is_string)?;
        let parameters = nullable("parameters", Value::is_object)?;
        let strict = nullable("strict", Value::is_boolean)?;
        let mut fn_defer = nullable("defer_loading", Value::is_boolean)?;
        let defer = match item.get("defer_loading") {
            None => Value::Null,
            Some(v) if v.is_null() || v.is_boolean() => v.clone(),
            Some(_) => return Err(bad("tool `defer_loading` must be a boolean")),
        };
        if fn_defer.is_null() && !defer.is_null() {
            fn_defer = defer.clone();
        }
        let mut f = Map::new();
        f.insert("name".to_owned(), Value::String(name.clone()));
        f.insert("description".to_owned(), description);
        f.insert("parameters".to_owned(), parameters);
        if !strict.is_null() {
            f.insert("strict".to_owned(), strict);
        }
        if !fn_defer.is_null() {
            f.insert("defer_loading".to_owned(), fn_defer);
        }
        let mut t = Map::new();
        t.insert("type".to_owned(), "function".into());
        t.insert("function".to_owned(), Value::Object(f));
        if !defer.is_null() {
            t.insert("defer_loading".to_owned(), defer);
        }
        out.push(Value::Object(t));
    }
    Ok(Value::Array(out))
}

/// The size of `value` as compact JSON, roughly (string bytes plus structure, numbers counted
/// as 8 bytes), without serializing. Counting stops once past `cap`: a result above `cap` only
/// says "more than `cap`".
pub(crate) fn json_size(value: &Value, cap: usize) -> usize {
    fn walk(v: &Value, acc: &mut usize, cap: usize) {
        match v {
            Value::Null | Value::Bool(_) => *acc += 5,
            Value::Number(_) => *acc += 8,
            Value::String(s) => *acc += s.len() + 2,
            Value::Array(a) => {
                *acc += 2 + a.len();
                for x in a {
                    if *acc > cap {
                        return;
                    }
                    walk(x, acc, cap);
                }
            }
            Value::Object(o) => {
                *acc += 2 + o.len() * 2;
                for (k, x) in o {
                    if *acc > cap {
                        return;
                    }
                    *acc += k.len() + 2;
                    walk(x, acc, cap);
                }
            }
        }
    }
    let mut acc = 0;
    walk(value, &mut acc, cap);
    acc
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn one(m: Value, format: ContentFormat) -> Result<Value> {
        normalize(&[m], format, false).map(|v| Value::Object(v.into_iter().next().unwrap()))
    }

    #[test]
    fn text_parts_join_with_newlines_and_drop_empty_ones() {
        let m = json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b",
            {"type": "input_text", "text": "c"}, {"type": "text", "text": null}
        ], "extra": 1});
        assert_eq!(
            one(m.clone(), ContentFormat::String).unwrap(),
            json!({"role": "user", "content": "a\nb\nc"})
        );
        assert_eq!(
            one(m, ContentFormat::OpenAi).unwrap(),
            json!({"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                {"type": "text", "text": "c"}
            ]})
        );
        assert_eq!(
            one(
                json!({"role": "user", "content": null}),
                ContentFormat::String
            )
            .unwrap(),
            json!({"role": "user", "content": ""})
        );
    }

    #[test]
    fn media_parts_are_refused_with_their_type() {
        for part in [
            json!({"type": "image_url", "image_url": {"url": "http://x/a.png"}}),
            json!({"image_url": "http://x/a.png"}),
            json!({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
        ] {
            let err = one(
                json!({"role": "user", "content": [part]}),
                ContentFormat::String,
            )
            .unwrap_err();
            assert!(
                matches!(err, TokenizeError::UnsupportedContent { index: 0, .. }),
                "{err}"
            );
        }
        let err = one(
            json!({"role": "user", "content": [{"text": "x"}]}),
            ContentFormat::String,
        )
        .unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidMessage { .. }));
        let err = one(json!({"role": "user", "content": 5}), ContentFormat::String).unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidMessage { .. }));
        let err = one(json!({"content": "x"}), ContentFormat::String).unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidMessage { .. }));
    }

    #[test]
    fn assistant_fields_follow_vllm() {
        let m = json!({"role": "assistant", "content": null, "reasoning_content": "think",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}
        ]});
        let out = one(m, ContentFormat::String).unwrap();
        assert_eq!(out["content"], "");
        assert_eq!(out["reasoning"], "think");
        assert_eq!(out["reasoning_content"], "think");
        let args = &out["tool_calls"][0]["function"]["arguments"];
        assert_eq!(args, &json!({"b": 1, "a": 2}));
        // Key order survives (Python dicts keep insertion order).
        let keys: Vec<_> = args.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["b", "a"]);
        assert_eq!(out["tool_calls"][1]["function"]["arguments"], json!({}));
        assert_eq!(out["tool_calls"][2]["function"]["arguments"], json!({}));
        let keys: Vec<_> = out.as_object().unwrap().keys().cloned().collect();
        assert_eq!(
            keys,
            [
                "role",
                "content",
                "tool_calls",
                "reasoning",
                "reasoning_content"
            ]
        );

        let empty = one(
            json!({"role": "assistant", "content": "x", "tool_calls": []}),
            ContentFormat::String,
        )
        .unwrap();
        assert_eq!(empty, json!({"role": "assistant", "content": "x"}));
        let err = one(
            json!({"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]}),
            ContentFormat::String,
        )
        .unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidMessage { .. }));
    }

    #[test]
    fn tool_messages_keep_their_id_and_flatten_text_parts() {
        let m = json!({"role": "tool", "tool_call_id": "c1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(
            one(m, ContentFormat::OpenAi).unwrap(),
            json!({"role": "tool", "content": "a\nb", "tool_call_id": "c1"})
        );
    }

    #[test]
    fn developer_messages_become_one_system_message() {
        let msgs = [
            json!({"role": "system", "content": "S"}),
            json!({"role": "user", "content": "U"}),
            json!({"role": "developer", "content": "D", "tools": []}),
        ];
        let out = normalize(&msgs, ContentFormat::String, false).unwrap();
        assert_eq!(
            Value::Array(out.into_iter().map(Value::Object).collect()),
            json!([{"role": "system", "content": "S\n\nD"}, {"role": "user", "content": "U"}])
        );
        let out = normalize(&msgs, ContentFormat::String, true).unwrap();
        assert_eq!(out[2]["role"], "developer");
        assert_eq!(out[2]["tools"], json!([]));
    }

    #[test]
    fn billing_header_line_is_dropped_from_system_prompts() {
        let m =
            json!({"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."});
        assert_eq!(
            one(m, ContentFormat::String).unwrap()["content"],
            "Be brief."
        );
        let m = json!({"role": "user", "content": "x-anthropic-billing-header: cch=1\nHi"});
        assert_eq!(
            one(m, ContentFormat::String).unwrap()["content"],
            "x-anthropic-billing-header: cch=1\nHi"
        );
    }

    #[test]
    fn tools_are_dumped_like_vllm_models() {
        let tools = json!([{"type": "function", "extra": 1, "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}, "x": 2}}]);
        assert_eq!(
            normalize_tools(&tools).unwrap(),
            json!([{"type": "function", "function": {
                "name": "f", "description": null,
                "parameters": {"type": "object", "properties": {}}}}])
        );
        assert!(normalize_tools(&json!({})).is_err());
        assert!(normalize_tools(&json!([{"function": {}}])).is_err());
        assert!(normalize_tools(&json!([{"type": "x", "function": {"name": "f"}}])).is_err());
    }

    #[test]
    fn json_size_bound() {
        let v = json!({"a": "x".repeat(100)});
        assert!(json_size(&v, 50) > 50);
        let exact = serde_json::to_string(&v).unwrap().len();
        let counted = json_size(&v, 1000);
        assert!(
            counted >= exact && counted < exact + 16,
            "{counted} vs {exact}"
        );
    }
}
