//! Bodies at the proxy's edges: a response body that keeps the request counted in flight until
//! it is fully sent (or dropped), and bounded collection of a request body.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};

use super::error::ProxyError;
use super::metrics::InFlight;

/// A body relayed frame by frame (never buffered), holding the in-flight guard.
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    _guard: InFlight,
}

impl<B> Tracked<B> {
    /// Wraps `inner`; the request stays in flight until this body is done or dropped.
    pub fn new(inner: B, guard: InFlight) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether an error (or one of its causes) is a body-limit overrun.
pub fn is_over_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.is::<LengthLimitError>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A request body that errors once more than `limit` bytes have passed, for streaming upstream.
pub fn limited(body: Body, limit: usize) -> Body {
    Body::new(Limited::new(body, limit))
}

/// Reads a whole request body, refusing more than `limit` bytes.
pub async fn collect(body: Body, limit: usize) -> Result<Bytes, ProxyError> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if is_over_limit(e.as_ref()) => Err(ProxyError::TooLarge { limit }),
        Err(e) => Err(ProxyError::BadBody(format!("reading the body failed: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;

    #[tokio::test]
    async fn collect_enforces_the_limit() {
        let ok = collect(Body::from(vec![b'x'; 10]), 10).await.unwrap();
        assert_eq!(ok.len(), 10);
        let err = collect(Body::from(vec![b'x'; 11]), 10).await.unwrap_err();
        assert!(matches!(err, ProxyError::TooLarge { limit: 10 }));
    }

    #[tokio::test]
    async fn tracked_body_releases_the_guard_when_dropped() {
        let m = std::sync::Arc::new(super::super::metrics::ProxyMetrics::new(None));
        let body = Tracked::new(Body::from("abc"), m.in_flight());
        assert_eq!(m.in_flight_now(), 1);
        let bytes = Body::new(body).collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"abc");
        assert_eq!(m.in_flight_now(), 0);
    }
}
