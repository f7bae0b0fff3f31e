//! Chat templates rendered as Hugging Face `apply_chat_template` renders them (jinja2 with
//! `trim_blocks` and `lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that is
//! Python's `json.dumps(ensure_ascii=False)`, Python string methods, and Python's `str()` for
//! printed values), on messages normalized as vLLM normalizes them.
//!
//! Known differences from jinja2, none of which the common chat templates hit: the `~`
//! operator and `join` print `none`/`true` where Python prints `None`/`True`; unassigned code
//! points count as printable in `repr`; `{% generation %}` blocks render their body (they only
//! mark assistant tokens for training masks).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value as JValue};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};
use serde_json::Value;

use crate::config::TemplateSource;
use crate::error::{LoadError, Result, TokenizeError};
use crate::messages::{self, ContentFormat, Message};
use crate::pyfmt;
use crate::strftime::DateTime;
use crate::{ChatOptions, Limits};

/// What `transformers` appends to the final message to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// One compiled template and what vLLM derives from its source.
#[derive(Debug)]
struct Compiled {
    name: String,
    file: PathBuf,
    /// Whether `content` appears in the source (needed by `continue_final_message`).
    mentions_content: bool,
    content_format: ContentFormat,
    supports_developer: bool,
}

/// The chat templates of one tokenizer, compiled once.
#[derive(Debug)]
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    templates: Vec<Compiled>,
    /// `(name, content)` of the special tokens passed to every render.
    special_tokens: Vec<(String, String)>,
}

/// The environment Hugging Face sets up, plus fuel against runaway templates.
fn environment(fuel: u64) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(fuel));
    env.set_formatter(|out, _state, value| {
        let text = pyfmt::python_str(value)?;
        out.write_str(&text)
            .map_err(|e| Error::new(ErrorKind::WriteFailure, "cannot write").with_source(e))
    });
    env.add_filter("tojson", pyfmt::tojson_filter);
    env.add_filter("string", pyfmt::string_filter);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<JValue, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| {
        DateTime::now().format(&format)
    });
    Ok(env)
}

impl ChatTemplates {
    /// Compiles `sources`; `special_tokens` are the `bos_token`, `eos_token`… values to pass.
    pub(crate) fn new(
        sources: &[TemplateSource],
        special_tokens: Vec<(String, String)>,
        limits: &Limits,
    ) -> Result<Self, LoadError> {
        let template_error = |file: &Path, name: &str, source: Error| LoadError::Template {
            file: file.to_owned(),
            name: name.to_owned(),
            source,
        };
        let fallback_file = sources.first().map(|s| s.file.clone()).unwrap_or_default();
        let mut env = environment(limits.render_fuel)
            .map_err(|e| template_error(&fallback_file, "(environment)", e))?;
        let mut templates = Vec::with_capacity(sources.len());
        for src in sources {
            let source = replace_generation_tags(&src.source);
            env.add_template_owned(src.name.clone(), source)
                .map_err(|e| template_error(&src.file, &src.name, e))?;
            templates.push(Compiled {
                name: src.name.clone(),
                file: src.file.clone(),
                mentions_content: src.source.contains("content"),
                content_format: detect_content_format(&src.source),
                supports_developer: src.source.contains("\"developer\"")
                    || src.source.contains("'developer'"),
            });
        }
        Ok(Self {
            env,
            templates,
            special_tokens,
        })
    }

    /// Sets the fuel (template instructions) one render may use.
    pub(crate) fn set_fuel(&mut self, fuel: u64) {
        self.env.set_fuel(Some(fuel));
    }

    /// Whether any template is available.
    pub(crate) fn is_empty(&self) -> bool {
        self.templates.is_empty()
    }

    /// The content format detected for the template a request with (or without) tools uses.
    pub(crate) fn content_format(&self, with_tools: bool) -> Option<ContentFormat> {
        self.select(with_tools).ok().map(|t| t.content_format)
    }

    /// `transformers`' choice: `tool_use` when tools are given and it exists, else `default`.
    fn select(&self, with_tools: bool) -> Result<&Compiled> {
        let by_name = |n: &str| self.templates.iter().find(|t| t.name == n);
        if with_tools && let Some(t) = by_name("tool_use") {
            return Ok(t);
        }
        if let Some(t) = by_name("default") {
            return Ok(t);
        }
        match self.templates.as_slice() {
            [only] => Ok(only),
            _ => Err(TokenizeError::NoChatTemplate),
        }
    }

    /// The file the selected template came from (for diagnostics).
    pub(crate) fn file(&self, with_tools: bool) -> Option<&Path> {
        self.select(with_tools).ok().map(|t| t.file.as_path())
    }

    /// Normalizes `messages` and renders the chat.
    pub(crate) fn render(&self, messages: &[Value], opts: &ChatOptions) -> Result<String> {
        let tools = match &opts.tools {
            None | Some(Value::Null) => None,
            Some(t) => Some(messages::normalize_tools(t)?),
        };
        let template = self.select(tools.is_some())?;
        let mut msgs = messages::normalize(
            messages,
            template.content_format,
            template.supports_developer,
        )?;
        let final_text = if opts.continue_final_message {
            Some(mark_final_message(&mut msgs, template.mentions_content)?)
        } else {
            None
        };

        let mut ctx: BTreeMap<String, JValue> = BTreeMap::new();
        for (name, content) in &self.special_tokens {
            ctx.insert(name.clone(), JValue::from(content.as_str()));
        }
        for (k, v) in &opts.template_kwargs {
            ctx.insert(k.clone(), JValue::from(Serde(v)));
        }
        ctx.insert("messages".to_owned(), JValue::from(Serde(&msgs)));
        let none = || JValue::from(());
        let tools = tools.as_ref().map(|t| JValue::from(Serde(t)));
        ctx.insert("tools".to_owned(), tools.unwrap_or_else(none));
        let documents = opts.documents.as_ref().map(|d| JValue::from(Serde(d)));
        ctx.insert("documents".to_owned(), documents.unwrap_or_else(none));
        ctx.insert(
            "add_generation_prompt".to_owned(),
            JValue::from(opts.add_generation_prompt),
        );

        let tmpl = self
            .env
            .get_template(&template.name)
            .map_err(|source| TokenizeError::Template { source })?;
        let rendered = tmpl
            .render(ctx)
            .map_err(|source| TokenizeError::Template { source })?;
        match final_text {
            Some(final_text) => cut_at_continue_tag(rendered, &final_text),
            None => Ok(rendered),
        }
    }
}

/// Appends [`CONTINUE_TAG`] to the final message's text (the last text part of a list); returns
/// that text as it was.
pub(crate) fn mark_final_message(msgs: &mut [Message], mentions_content: bool) -> Result<String> {
    let err = |reason: &str| TokenizeError::ContinueFinalMessage {
        reason: reason.to_owned(),
    };
    let last = msgs
        .last_mut()
        .ok_or_else(|| err("there are no messages"))?;
    if !mentions_content {
        return Err(err("the chat template never uses `content`"));
    }
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Value::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(s)) = part.get_mut("text") {
                    let text = s.clone();
                    s.push_str(CONTINUE_TAG);
                    return Ok(text);
                }
            }
            Err(err("the final message has no text to continue"))
        }
        _ => Err(err("the final message has no content to continue")),
    }
}

/// Cuts the rendered chat where the final message ends, as `transformers` does.
pub(crate) fn cut_at_continue_tag(rendered: String, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(TokenizeError::ContinueFinalMessage {
            reason: "the final message does not appear in the rendered chat".to_owned(),
        });
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    let head = rendered.get(..at).unwrap_or_default();
    let kept = if rendered
        .get(at..)
        .is_some_and(|t| t.starts_with(CONTINUE_TAG))
    {
        head
    } else {
        head.trim_end()
    };
    Ok(kept.to_owned())
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (a `transformers` extension that marks
/// assistant tokens) by `{% if true %}` / `{% endif %}`, keeping the whitespace-control marks so
/// that the output is the same.
pub(crate) fn replace_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = tag.get(2..end).unwrap_or_default();
        let (open_mark, inner) = split_mark_front(inner);
        let (inner, close_mark) = split_mark_back(inner);
        let replacement = match inner.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(open_mark);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(close_mark);
                out.push_str("%}");
            }
            None => out.push_str(tag.get(..end + 2).unwrap_or_default()),
        }
        rest = tag.get(end + 2..).unwrap_or_default();
    }
    out.push_str(rest);
    out
}

fn split_mark_front(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some(c @ ('-' | '+')) => s.split_at(c.len_utf8()),
        _ => ("", s),
    }
}

fn split_mark_back(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some(c @ ('-' | '+')) => s.split_at(s.len() - c.len_utf8()),
        _ => (s, ""),
    }
}

/// vLLM's content-format detection, over the template's statements instead of jinja2's AST:
/// the template takes [`ContentFormat::OpenAi`] content when some `for` loop iterates over a
/// message's `content` (`for part in message['content']`, `message.content`, through `set`
/// aliases of `messages` and slices or filters of it), or over a variable named `content`
/// outside macros; otherwise [`ContentFormat::String`].
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let statements = statements(source);
    let mut list_names = vec!["messages".to_owned()];
    // `set x = messages…` aliases, to a fixed point.
    loop {
        let before = list_names.len();
        for st in &statements {
            if let Statement::Set { name, expr } = st
                && !list_names.contains(name)
                && is_list_access(expr, &list_names)
            {
                list_names.push(name.clone());
            }
        }
        if list_names.len() == before {
            break;
        }
    }
    let message_vars: Vec<String> = statements
        .iter()
        .filter_map(|st| match st {
            Statement::For { target, iter, .. } if is_list_access(iter, &list_names) => {
                Some(target.clone())
            }
            _ => None,
        })
        .collect();
    let iterates_content = statements.iter().any(|st| match st {
        Statement::For { iter, in_macro, .. } => {
            is_content_access(iter, &message_vars)
                || (!*in_macro
                    && iter.first().map(String::as_str) == Some("content")
                    && iter.len() == 1)
        }
        _ => false,
    });
    if iterates_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// The statements that matter for [`detect_content_format`], as token lists.
#[derive(Debug)]
enum Statement {
    For {
        target: String,
        iter: Vec<String>,
        in_macro: bool,
    },
    Set {
        name: String,
        expr: Vec<String>,
    },
}

fn statements(source: &str) -> Vec<Statement> {
    let mut out = Vec::new();
    let mut macro_depth = 0usize;
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let tag = rest.get(start + 2..).unwrap_or_default();
        let Some(end) = tag.find("%}") else { break };
        let inner = tag.get(..end).unwrap_or_default();
        rest = tag.get(end + 2..).unwrap_or_default();
        let inner = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let tokens = lex(inner);
        match tokens.first().map(String::as_str) {
            Some("macro") => macro_depth += 1,
            Some("endmacro") => macro_depth = macro_depth.saturating_sub(1),
            Some("for") => {
                // for TARGET in EXPR [if …] [recursive]
                if let (Some(target), Some("in")) =
                    (tokens.get(1), tokens.get(2).map(String::as_str))
                {
                    let iter: Vec<String> = tokens
                        .iter()
                        .skip(3)
                        .take_while(|t| *t != "if" && *t != "recursive")
                        .cloned()
                        .collect();
                    out.push(Statement::For {
                        target: target.clone(),
                        iter,
                        in_macro: macro_depth > 0,
                    });
                }
            }
            Some("set") => {
                if let (Some(name), Some("=")) = (tokens.get(1), tokens.get(2).map(String::as_str))
                {
                    out.push(Statement::Set {
                        name: name.clone(),
                        expr: tokens.iter().skip(3).cloned().collect(),
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Splits an expression into identifiers, string literals (quotes removed, marked with a
/// leading `"`), numbers and single punctuation characters.
fn lex(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(s.get(i..end).unwrap_or_default().to_owned());
        } else if c == '\'' || c == '"' {
            let mut lit = String::from('"');
            for (_, d) in chars.by_ref() {
                if d == c {
                    break;
                }
                lit.push(d);
            }
            out.push(lit);
        } else {
            out.push(c.to_string());
        }
    }
    out
}

/// `NAME`, `NAME[a:b]` or `NAME | filter…` with NAME one of `names` (the list itself, not an item).
fn is_list_access(expr: &[String], names: &[String]) -> bool {
    let Some(first) = expr.first() else {
        return false;
    };
    if !names.contains(first) {
        return false;
    }
    match expr.get(1).map(String::as_str) {
        None | Some("|") | Some(")") => true,
        Some("[") => {
            // A slice has a `:` before the matching `]`.
            let mut depth = 0usize;
            for t in expr.iter().skip(1) {
                match t.as_str() {
                    "[" => depth += 1,
                    "]" => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return false;
                        }
                    }
                    ":" if depth == 1 => return true,
                    _ => {}
                }
            }
            false
        }
        _ => false,
    }
}

/// `M.content` or `M['content']` (optionally sliced or filtered) with M one of `vars`.
fn is_content_access(expr: &[String], vars: &[String]) -> bool {
    let Some(first) = expr.first() else {
        return false;
    };
    if !vars.contains(first) {
        return false;
    }
    let rest: Vec<&str> = expr.iter().skip(1).take(3).map(String::as_str).collect();
    matches!(
        rest.as_slice(),
        [".", "content", ..] | ["[", "\"content", "]"]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_no_op_blocks() {
        let src = "a{%- generation -%}b{% endgeneration %}c{% if x %}{% endif %}";
        assert_eq!(
            replace_generation_tags(src),
            "a{%- if true -%}b{% endif %}c{% if x %}{% endif %}"
        );
    }

    #[test]
    fn content_format_detection() {
        let string = "{% for message in messages %}{{ message.content }}{% endfor %}";
        assert_eq!(detect_content_format(string), ContentFormat::String);
        let openai = "{% for message in messages %}{% for part in message['content'] %}\
                      {{ part.text }}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(openai), ContentFormat::OpenAi);
        let aliased = "{%- set loop_messages = messages[1:] -%}{% for m in loop_messages %}\
                       {%- for c in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(aliased), ContentFormat::OpenAi);
        let item_not_list = "{% set first = messages[0] %}{% for m in first %}\
                             {% for c in m.content %}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(item_not_list), ContentFormat::String);
        let bare = "{% for m in messages %}{% set content = m.content %}\
                    {% for c in content %}{% endfor %}{% endfor %}";
        assert_eq!(detect_content_format(bare), ContentFormat::OpenAi);
        let in_macro = "{% macro r(content) %}{% for c in content %}{% endfor %}{% endmacro %}";
        assert_eq!(detect_content_format(in_macro), ContentFormat::String);
    }

    #[test]
    fn continue_tag_cut() {
        // The template kept the final message as it was: "Hi " + tag.
        let out =
            cut_at_continue_tag("<a>Hi CONTINUE_FINAL_MESSAGE_TAG </a>".to_owned(), "Hi ").unwrap();
        assert_eq!(out, "<a>Hi ");
        // The template trimmed it, losing the tag's trailing space: cut and strip.
        let out =
            cut_at_continue_tag("<a>Hi CONTINUE_FINAL_MESSAGE_TAG</a>".to_owned(), "Hi ").unwrap();
        assert_eq!(out, "<a>Hi");
        assert!(cut_at_continue_tag("<a></a>".to_owned(), "Hi").is_err());
    }
}
