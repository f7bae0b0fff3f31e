//! The committed CRDs are exactly what the Rust types generate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

#[test]
fn committed_crds_match_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut drifted = Vec::new();
    for doc in kvgate_crdgen::documents().unwrap() {
        let committed = std::fs::read_to_string(root.join(&doc.path)).unwrap_or_default();
        if committed != doc.text {
            drifted.push(doc.path);
        }
    }
    assert!(
        drifted.is_empty(),
        "generated CRDs differ from the committed files {drifted:?}: run `cargo run -p kvgate-crdgen` and commit"
    );
}
