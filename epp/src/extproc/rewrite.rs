//! Rewriting the served model name back to the client's in response bodies (GIE's
//! `rewriteModelName`), chunk by chunk, including occurrences split across chunks.

/// Replaces the served model name by the client's in a response body, chunk by chunk.
///
/// Holds back at most one pattern's length minus one byte at a chunk's end, and only while
/// those bytes could start an occurrence; everything is released at the end of the stream.
#[derive(Debug, Clone)]
pub struct ResponseRewriter {
    patterns: [Vec<u8>; 2],
    replacements: [Vec<u8>; 2],
    held: Vec<u8>,
}

impl ResponseRewriter {
    /// Rewrites `"model":"<served>"` to `"model":"<client>"`.
    pub fn new(served: &str, client: &str) -> Self {
        let quoted = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""));
        let (served, client) = (quoted(served), quoted(client));
        Self {
            patterns: [
                format!("\"model\":{served}").into_bytes(),
                format!("\"model\": {served}").into_bytes(),
            ],
            replacements: [
                format!("\"model\":{client}").into_bytes(),
                format!("\"model\": {client}").into_bytes(),
            ],
            held: Vec::new(),
        }
    }

    /// Releases what is held back (the stream ended without a final body chunk).
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// Rewrites the next chunk; `last` releases everything held.
    pub fn feed(&mut self, chunk: &[u8], last: bool) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(buf.len());
        let mut i = 0;
        'scan: while i < buf.len() {
            for (p, r) in self.patterns.iter().zip(&self.replacements) {
                if buf.get(i..i + p.len()) == Some(p.as_slice()) {
                    out.extend_from_slice(r);
                    i += p.len();
                    continue 'scan;
                }
            }
            if !last {
                let rest = buf.get(i..).unwrap_or_default();
                if self
                    .patterns
                    .iter()
                    .any(|p| rest.len() < p.len() && p.starts_with(rest))
                {
                    self.held = rest.to_vec();
                    return out;
                }
            }
            if let Some(b) = buf.get(i) {
                out.push(*b);
            }
            i += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use proptest::prelude::*;

    fn naive(body: &[u8], served: &str, client: &str) -> Vec<u8> {
        let s = String::from_utf8(body.to_vec()).unwrap();
        s.replace(
            &format!("\"model\":\"{served}\""),
            &format!("\"model\":\"{client}\""),
        )
        .replace(
            &format!("\"model\": \"{served}\""),
            &format!("\"model\": \"{client}\""),
        )
        .into_bytes()
    }

    proptest! {
        #[test]
        fn any_chunking_equals_replacing_the_whole(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just("data: {\"id\":1,\"model\":\"lora-a\",\"x\":\"y\"}\n\n".to_owned()),
                    Just("{\"model\": \"lora-a\"}".to_owned()),
                    Just("\"model\":\"lora-ab\"".to_owned()),
                    Just("\"mod".to_owned()),
                    "[a-z\" :]{0,12}",
                ],
                0..12,
            ),
            cuts in proptest::collection::vec(0usize..200, 0..10),
        ) {
            let body = parts.concat().into_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
            cuts.sort_unstable();
            let mut rw = ResponseRewriter::new("lora-a", "llama");
            let mut out = Vec::new();
            let mut at = 0;
            for c in cuts {
                out.extend(rw.feed(&body[at..c], false));
                at = c;
            }
            out.extend(rw.feed(&body[at..], true));
            prop_assert_eq!(out, naive(&body, "lora-a", "llama"));
        }
    }

    #[test]
    fn holds_back_only_a_possible_prefix() {
        let mut rw = ResponseRewriter::new("s", "c");
        assert_eq!(rw.feed(b"abc\"mo", false), b"abc");
        assert_eq!(rw.feed(b"del\":\"s\"}", false), b"\"model\":\"c\"}");
        assert_eq!(rw.feed(b"\"mo", true), b"\"mo");
    }
}
