//! Request body collection (bounded) and re-chunking for `FULL_DUPLEX_STREAMED` replies.

use envoy_types::pb::envoy::service::ext_proc::v3::StreamedBodyResponse;

/// Largest body chunk sent back to Envoy: some Envoy builds cap a streamed chunk at 64 KiB, and
/// GIE re-chunks at 62,000 bytes (`pkg/common/envoy/chunking.go`).
pub const MAX_CHUNK_BYTES: usize = 62_000;

/// The request body gathered so far, never larger than its limit.
#[derive(Debug)]
pub(super) struct BodyBuffer {
    bytes: Vec<u8>,
    limit: usize,
}

/// The body went past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TooLarge {
    /// The configured limit.
    pub(super) limit: usize,
    /// How many bytes were seen when it was exceeded (or announced by `content-length`).
    pub(super) seen: usize,
}

impl BodyBuffer {
    /// A buffer for a body of at most `limit` bytes, allocated once when the client announced
    /// its length, so that large prompts are not copied through repeated growth.
    pub(super) fn new(limit: usize, content_length: Option<usize>) -> Result<Self, TooLarge> {
        match content_length {
            Some(seen) if seen > limit => Err(TooLarge { limit, seen }),
            Some(len) => Ok(Self {
                bytes: Vec::with_capacity(len),
                limit,
            }),
            None => Ok(Self {
                bytes: Vec::new(),
                limit,
            }),
        }
    }

    /// Appends a chunk, refusing to grow past the limit.
    pub(super) fn push(&mut self, chunk: &[u8]) -> Result<(), TooLarge> {
        let seen = self.bytes.len().saturating_add(chunk.len());
        if seen > self.limit {
            return Err(TooLarge {
                limit: self.limit,
                seen,
            });
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    /// The body collected.
    pub(super) fn into_inner(self) -> Vec<u8> {
        self.bytes
    }
}

/// Splits `body` into `streamed_response` chunks of at most [`MAX_CHUNK_BYTES`]; the last one
/// carries `end_of_stream`. An empty body still yields one (empty) chunk so the stream can end.
pub(super) fn streamed_chunks(
    body: &[u8],
    end_of_stream: bool,
) -> impl Iterator<Item = StreamedBodyResponse> + '_ {
    let count = body.len().div_ceil(MAX_CHUNK_BYTES).max(1);
    let mut pieces = body.chunks(MAX_CHUNK_BYTES);
    (0..count).map(move |i| StreamedBodyResponse {
        body: pieces.next().unwrap_or_default().to_vec(),
        end_of_stream: end_of_stream && i + 1 == count,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_bounded_ordered_and_end_once() {
        for len in [
            0,
            1,
            MAX_CHUNK_BYTES - 1,
            MAX_CHUNK_BYTES,
            MAX_CHUNK_BYTES + 1,
            1 << 20,
        ] {
            let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let chunks: Vec<_> = streamed_chunks(&body, true).collect();
            assert_eq!(
                chunks.len(),
                len.div_ceil(MAX_CHUNK_BYTES).max(1),
                "len {len}"
            );
            assert!(chunks.iter().all(|c| c.body.len() <= MAX_CHUNK_BYTES));
            assert_eq!(chunks.iter().filter(|c| c.end_of_stream).count(), 1);
            assert!(chunks.last().unwrap().end_of_stream);
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.body.clone()).collect();
            assert_eq!(joined, body);
        }
    }

    #[test]
    fn chunks_leave_end_of_stream_to_trailers() {
        let body = vec![7u8; 2 * MAX_CHUNK_BYTES + 5];
        assert!(streamed_chunks(&body, false).all(|c| !c.end_of_stream));
    }

    #[test]
    fn buffer_refuses_past_limit_and_announced_oversize() {
        assert_eq!(
            BodyBuffer::new(10, Some(11)).unwrap_err(),
            TooLarge {
                limit: 10,
                seen: 11
            }
        );
        let mut b = BodyBuffer::new(10, None).unwrap();
        b.push(b"hello").unwrap();
        b.push(b"world").unwrap();
        assert_eq!(
            b.push(b"!"),
            Err(TooLarge {
                limit: 10,
                seen: 11
            })
        );
        assert_eq!(b.into_inner(), b"helloworld");
    }
}
