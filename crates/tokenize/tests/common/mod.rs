//! Locating the real Qwen3 tokenizer and the shared vLLM fixtures.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use tokenize::TextTokenizer;

/// `$KVGATE_TOKENIZER_DIR`, or the directory `scripts/bootstrap.sh` fills. Missing files fail
/// the test unless `KVGATE_ALLOW_MISSING_TOKENIZER=1`, in which case this returns `None`.
pub(crate) fn tokenizer_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../.cache/tokenizers/qwen3/package/models")
        });
    if dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file() {
        return Some(dir);
    }
    if std::env::var("KVGATE_ALLOW_MISSING_TOKENIZER").as_deref() == Ok("1") {
        eprintln!(
            "skipping: no tokenizer at {} (KVGATE_ALLOW_MISSING_TOKENIZER=1)",
            dir.display()
        );
        return None;
    }
    panic!(
        "the Qwen3 tokenizer is missing at {}: run scripts/bootstrap.sh, set KVGATE_TOKENIZER_DIR, \
         or set KVGATE_ALLOW_MISSING_TOKENIZER=1 to skip",
        dir.display()
    );
}

/// The Qwen3 tokenizer, loaded once per test binary.
pub(crate) fn qwen3() -> Option<&'static TextTokenizer> {
    static TOK: OnceLock<Option<TextTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        tokenizer_dir().map(|dir| {
            TextTokenizer::from_dir(&dir)
                .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
        })
    })
    .as_ref()
}

/// The shared folder beside the checkout (or `$KVGATE_SHARED`).
pub(crate) fn shared() -> PathBuf {
    let dir = std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    assert!(
        dir.join("fixtures").is_dir(),
        "fixtures not found under {} (set KVGATE_SHARED to the shared/ folder)",
        dir.display()
    );
    dir
}

pub(crate) fn read_json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
