//! The public API on small hand-made tokenizer directories and the byte fallback: loading
//! errors, template features and failures, input limits, content parts, and the fallback's
//! formula and round trip.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use serde_json::{Value, json};
use tokenize::{
    BYTE_EOS_ID, ChatOptions, ContentFormat, Limits, LoadError, TextTokenizer, TokenizeError,
};

/// A tiny word-level `tokenizer.json`: whitespace pre-tokenizer, a few words, `<eos>` special.
const TINY_TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "<unk>",
            "vocab": {"<eos>": 0, "<unk>": 1, "hello": 2, "world": 3, "user": 4, ":": 5}}
}"#;

/// A directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh directory under the system temp dir holding `files`.
fn model_dir(files: &[(&str, &str)]) -> TempDir {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvgate-tokenize-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    TempDir(dir)
}

fn config(template: &str) -> String {
    json!({"eos_token": {"content": "<eos>"}, "bos_token": "<s>", "chat_template": template})
        .to_string()
}

fn tiny(template: &str) -> TextTokenizer {
    let dir = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        ("tokenizer_config.json", &config(template)),
    ]);
    TextTokenizer::from_dir(&dir).unwrap()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn file_of(err: &LoadError) -> &Path {
    match err {
        LoadError::Read { file, .. }
        | LoadError::Json { file, .. }
        | LoadError::Tokenizer { file, .. }
        | LoadError::Field { file, .. }
        | LoadError::Template { file, .. } => file,
    }
}

#[test]
fn missing_files_are_typed_errors_naming_the_file() {
    let empty = model_dir(&[]);
    let err = TextTokenizer::from_dir(&empty).unwrap_err();
    assert!(matches!(err, LoadError::Read { .. }), "{err}");
    assert_eq!(file_of(&err), empty.join("tokenizer.json"));
    assert!(err.to_string().contains("tokenizer.json"));

    let no_config = model_dir(&[("tokenizer.json", TINY_TOKENIZER)]);
    let err = TextTokenizer::from_dir(&no_config).unwrap_err();
    assert!(matches!(err, LoadError::Read { .. }), "{err}");
    assert_eq!(file_of(&err), no_config.join("tokenizer_config.json"));

    let garbage = model_dir(&[
        ("tokenizer.json", "{\"model\": 3}"),
        ("tokenizer_config.json", "{}"),
    ]);
    let err = TextTokenizer::from_dir(&garbage).unwrap_err();
    assert!(matches!(err, LoadError::Tokenizer { .. }), "{err}");
    assert_eq!(err.metric_label(), "tokenizer");

    let bad_config = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        ("tokenizer_config.json", "["),
    ]);
    let err = TextTokenizer::from_dir(&bad_config).unwrap_err();
    assert!(matches!(err, LoadError::Json { .. }), "{err}");
    assert_eq!(file_of(&err), bad_config.join("tokenizer_config.json"));
}

#[test]
fn bad_template_is_a_typed_load_error() {
    let dir = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        (
            "tokenizer_config.json",
            &config("{% for m in messages %}{{ m.content }}"),
        ),
    ]);
    let err = TextTokenizer::from_dir(&dir).unwrap_err();
    let LoadError::Template { file, name, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(file, &dir.join("tokenizer_config.json"));
    assert_eq!(name, "default");
    assert_eq!(err.metric_label(), "template");
}

#[test]
fn raise_exception_and_runtime_errors_are_typed() {
    let tok = tiny(
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}",
    );
    let err = tok
        .encode_chat(&[user("hello")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Template { .. }), "{err}");
    assert!(err.to_string().contains("System first!"), "{err}");
    assert!(err.is_client_error());

    let tok = tiny("{{ messages[0].content.nosuchmethod() }}");
    let err = tok
        .encode_chat(&[user("hello")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Template { .. }), "{err}");
}

#[test]
fn runaway_templates_run_out_of_fuel() {
    let tok =
        tiny("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
            .with_limits(Limits {
                render_fuel: 100_000,
                ..Limits::default()
            });
    let start = std::time::Instant::now();
    let err = tok
        .render_chat(&[user("hello")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Template { .. }), "{err}");
    assert!(start.elapsed().as_secs() < 5);
    let tok = tiny("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    let err = tok
        .render_chat(&[user("hello")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizeError::Template { .. }), "{err}");
}

#[test]
fn oversized_input_is_refused() {
    let limits = Limits {
        max_input_bytes: 64,
        ..Limits::default()
    };
    for tok in [tiny("{{ messages[0].content }}"), TextTokenizer::fallback()] {
        let tok = tok.with_limits(limits);
        assert!(tok.encode_prompt(&"a".repeat(64)).is_ok());
        let err = tok.encode_prompt(&"a".repeat(65)).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizeError::InputTooLarge {
                    what: "prompt",
                    len: 65,
                    max: 64
                }
            ),
            "{err}"
        );
        let err = tok
            .encode_chat(&[user(&"a".repeat(100))], &ChatOptions::default())
            .unwrap_err();
        assert!(
            matches!(
                err,
                TokenizeError::InputTooLarge {
                    what: "chat request",
                    ..
                }
            ),
            "{err}"
        );
        let opts = ChatOptions {
            tools: Some(json!([{"type": "function", "function": {"name": "x".repeat(80)}}])),
            ..ChatOptions::default()
        };
        let err = tok.encode_chat(&[user("hi")], &opts).unwrap_err();
        assert_eq!(err.metric_label(), "input_too_large");
    }
    // A small request whose rendering blows up.
    let tok = tiny("{{ messages[0].content * 100 }}").with_limits(limits);
    let err = tok
        .encode_chat(&[user("hello")], &ChatOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::InputTooLarge {
                what: "rendered chat",
                len: 500,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn template_sees_hugging_face_variables_and_helpers() {
    let tok = tiny(
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|{{ documents }}|\
         {{ flag }}|{{ messages[0].content.upper().split('L') }}|{{ messages[0].get('name') }}|\
         {{ {'b': 1, 'a': [1.0, none, true]} | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(indent=2, sort_keys=true) }}|\
         {{ {'k': 'v'} }}|{% for k, v in {'z': 1, 'y': 2}.items() %}{{ k }}{{ v }}{% endfor %}|\
         {{ strftime_now('%Y') | length }}",
    );
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("flag".into(), json!(false));
    let opts = ChatOptions {
        add_generation_prompt: false,
        template_kwargs: kwargs,
        ..ChatOptions::default()
    };
    let out = tok.render_chat(&[user("hello")], &opts).unwrap();
    assert_eq!(
        out,
        "<s>|<eos>|False|None|None|False|['HE', '', 'O']|None|\
         {\"b\": 1, \"a\": [1.0, null, true]}|{\n  \"a\": \"é\",\n  \"b\": 1\n}|\
         {'k': 'v'}|z1y2|4"
    );
}

#[test]
fn trim_and_lstrip_blocks_match_jinja2() {
    let tok = tiny(
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n{% endfor %}\n",
    );
    let out = tok
        .render_chat(&[user("a"), user("b")], &ChatOptions::default())
        .unwrap();
    assert_eq!(out, "<a>\n<b>\n");
}

#[test]
fn generation_blocks_render_their_body() {
    let tok = tiny(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    );
    let out = tok
        .render_chat(&[user("hello")], &ChatOptions::default())
        .unwrap();
    assert_eq!(out, "hello");
}

#[test]
fn content_parts_follow_the_templates_format() {
    let parts = json!({"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]});
    let string_tok = tiny("{% for m in messages %}[{{ m.content }}]{% endfor %}");
    assert_eq!(
        string_tok.as_hf().unwrap().content_format(false),
        Some(ContentFormat::String)
    );
    let out = string_tok
        .render_chat(std::slice::from_ref(&parts), &ChatOptions::default())
        .unwrap();
    assert_eq!(out, "[hello\nworld]");
    assert_eq!(
        string_tok
            .encode_chat(std::slice::from_ref(&parts), &ChatOptions::default())
            .unwrap(),
        string_tok
            .encode_chat(&[user("hello\nworld")], &ChatOptions::default())
            .unwrap()
    );

    let openai_tok = tiny(
        "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}",
    );
    assert_eq!(
        openai_tok.as_hf().unwrap().content_format(false),
        Some(ContentFormat::OpenAi)
    );
    let out = openai_tok
        .render_chat(&[parts], &ChatOptions::default())
        .unwrap();
    assert_eq!(out, "<hello><world>");
    // A string becomes one text part.
    let out = openai_tok
        .render_chat(&[user("hi")], &ChatOptions::default())
        .unwrap();
    assert_eq!(out, "<hi>");

    let image = json!({"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]});
    for tok in [string_tok, TextTokenizer::fallback()] {
        let err = tok
            .encode_chat(std::slice::from_ref(&image), &ChatOptions::default())
            .unwrap_err();
        let TokenizeError::UnsupportedContent { index, part_type } = &err else {
            panic!("{err}")
        };
        assert_eq!((*index, part_type.as_str()), (0, "image_url"));
        assert_eq!(err.metric_label(), "unsupported_content");
    }
}

#[test]
fn named_templates_and_template_files() {
    let cfg = json!({"chat_template": [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"}]})
    .to_string();
    let dir = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        ("tokenizer_config.json", &cfg),
    ]);
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tok.render_chat(&[user("x")], &ChatOptions::default())
            .unwrap(),
        "plain"
    );
    let opts = ChatOptions {
        tools: Some(json!([{"type": "function", "function": {"name": "f"}}])),
        ..ChatOptions::default()
    };
    assert_eq!(tok.render_chat(&[user("x")], &opts).unwrap(), "tools:1");

    // chat_template.jinja wins over the config's template.
    let dir = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        ("tokenizer_config.json", &config("from config")),
        ("chat_template.jinja", "from file\n"),
    ]);
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tok.render_chat(&[user("x")], &ChatOptions::default())
            .unwrap(),
        "from file"
    );
    assert_eq!(
        tok.as_hf().unwrap().chat_template_file(false),
        Some(dir.join("chat_template.jinja").as_path())
    );

    // No template at all.
    let dir = model_dir(&[
        ("tokenizer.json", TINY_TOKENIZER),
        ("tokenizer_config.json", "{}"),
    ]);
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    assert!(tok.encode_prompt("hello world").is_ok());
    let err = tok
        .render_chat(&[user("x")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizeError::NoChatTemplate), "{err}");
    assert!(!err.is_client_error());
}

#[test]
fn conflicting_and_continue_options() {
    let tok =
        tiny("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}");
    let opts = ChatOptions {
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let err = tok.render_chat(&[user("x")], &opts).unwrap_err();
    assert!(matches!(err, TokenizeError::ConflictingOptions), "{err}");
    let opts = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let msgs = [
        user("q"),
        json!({"role": "assistant", "content": "Once upon"}),
    ];
    assert_eq!(
        tok.render_chat(&msgs, &opts).unwrap(),
        "<user>q</user><assistant>Once upon"
    );
}

#[test]
fn tiny_tokenizer_encodes_decodes_and_finds_eos() {
    let tok = tiny("{{ messages[0].content }}");
    assert!(tok.is_exact());
    assert_eq!(tok.encode_prompt("hello world").unwrap(), vec![2, 3]);
    assert_eq!(tok.decode(&[2, 0, 3]).unwrap(), "hello world");
    assert_eq!(tok.eos_token_id(), Some(0));
    assert_eq!(tok.vocab_size(), 6);
}

#[test]
fn fallback_chatml_is_fixed_and_documented() {
    let tok = TextTokenizer::fallback();
    assert!(!tok.is_exact());
    let msgs = [
        json!({"role": "system", "content": "Be brief."}),
        user("Hi"),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}),
        json!({"role": "tool", "tool_call_id": "1", "content": "ok"}),
    ];
    let opts = ChatOptions {
        tools: Some(json!([{"type": "function", "function": {"name": "f"}}])),
        ..ChatOptions::default()
    };
    let text = tok.render_chat(&msgs, &opts).unwrap();
    assert_eq!(
        text,
        "<|im_start|>tools\n{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":null,\"parameters\":null}}<|im_end|>\n\
         <|im_start|>system\nBe brief.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n\n<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call><|im_end|>\n\
         <|im_start|>tool\nok<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let ids = tok.encode_chat(&msgs, &opts).unwrap();
    assert_eq!(ids, tok.encode_prompt(&text).unwrap());
    assert_eq!(tok.decode(&ids).unwrap(), text);

    let opts = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let text = tok
        .render_chat(
            &[user("Hi"), json!({"role": "assistant", "content": "Once"})],
            &opts,
        )
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nOnce"
    );
}

#[test]
fn fallback_ids_follow_the_formula() {
    let tok = TextTokenizer::fallback();
    // "Hi" = 0x48 0x69; "abcd" = 0x61626364 little-endian.
    assert_eq!(tok.encode_prompt("Hi").unwrap(), vec![0x6948]);
    assert_eq!(
        tok.encode_prompt("abcdef").unwrap(),
        vec![0x6463_6261, 0x6665]
    );
    assert_eq!(tok.eos_token_id(), Some(BYTE_EOS_ID));
    assert_eq!(tok.decode(&[0x6948, BYTE_EOS_ID]).unwrap(), "Hi");
    assert_eq!(tok.vocab_size(), 1 << 31);
    let err = tok.decode(&[1 << 31]).unwrap_err();
    assert!(matches!(
        err,
        TokenizeError::UnknownTokenId { id: 0x8000_0000 }
    ));
    let words = tok.word_token_ids();
    assert!(words.len() >= 16);
    let text = tok.decode(words).unwrap();
    assert!(text.starts_with(" the and"));
    assert_eq!(tok.encode_prompt(&text).unwrap(), words);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fallback_round_trips_any_text(chars in prop::collection::vec(any::<char>(), 0..64)) {
        let tok = TextTokenizer::fallback();
        let text: String = chars.into_iter().collect();
        let ids = tok.encode_prompt(&text).unwrap();
        prop_assert!(ids.iter().all(|&id| id < 1 << 31 && id != BYTE_EOS_ID));
        prop_assert!(ids.len() >= text.len().div_ceil(4));
        prop_assert_eq!(tok.decode(&ids).unwrap(), text.clone());
        // Encoding is canonical: the decoded text gives the same ids.
        prop_assert_eq!(tok.encode_prompt(&tok.decode(&ids).unwrap()).unwrap(), ids);
    }

    #[test]
    fn fallback_round_trips_ascii_heavy_text(text in "[ -~\n\t\u{0}é😀]{0,80}") {
        let tok = TextTokenizer::fallback();
        let ids = tok.encode_prompt(&text).unwrap();
        prop_assert_eq!(tok.decode(&ids).unwrap(), text);
    }
}

#[test]
fn qwen3_word_ids_are_stable_and_template_is_string_format() {
    let Some(tok) = common::qwen3() else { return };
    let words = tok.word_token_ids();
    assert!(words.len() >= 64, "{}", words.len());
    assert!(!words.contains(&tok.eos_token_id().unwrap()));
    let text = tok.decode(words).unwrap();
    assert!(text.starts_with(' '));
    assert_eq!(tok.encode_prompt(&text).unwrap(), words);
    let hf = tok.as_hf().unwrap();
    assert_eq!(hf.content_format(false), Some(ContentFormat::String));
    assert!(
        hf.chat_template_file(false)
            .unwrap()
            .ends_with("tokenizer_config.json")
    );
}

#[test]
fn tokenizers_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TextTokenizer>();
}
