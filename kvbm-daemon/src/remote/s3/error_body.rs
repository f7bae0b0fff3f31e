//! Error answers read up to [`MAX_ERROR_BODY`]: the SDK reads an error's body whole to parse
//! S3's code from it, so a store (or a proxy) that answers with a long one would make the
//! daemon hold all of it. The code comes first in S3's `<Error>` document; the rest is cut off.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use aws_sdk_s3::config::interceptors::BeforeDeserializationInterceptorContextMut;
use aws_sdk_s3::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_s3::error::BoxError;
use aws_sdk_s3::primitives::SdkBody;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The most of an error answer's body that is read.
pub(super) const MAX_ERROR_BODY: usize = 16 << 10;

/// Cuts the body of every answer that is not a success to [`MAX_ERROR_BODY`] bytes.
#[derive(Debug)]
pub(super) struct BoundedErrorBody;

impl Intercept for BoundedErrorBody {
    fn name(&self) -> &'static str {
        "kvgate-kvbm bounded error body"
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let response = context.response_mut();
        if !response.status().is_success() {
            let body = response.take_body();
            *response.body_mut() = SdkBody::from_body_1_x(Cut {
                inner: body,
                left: MAX_ERROR_BODY,
            });
        }
        Ok(())
    }
}

/// A body that ends after `left` more bytes.
struct Cut {
    inner: SdkBody,
    left: usize,
}

impl Body for Cut {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.left == 0 {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => return Poll::Ready(other),
        };
        Poll::Ready(Some(Ok(match frame.into_data() {
            Ok(mut data) => {
                data.truncate(this.left);
                this.left -= data.len();
                Frame::data(data)
            }
            // Trailers pass as they are.
            Err(frame) => frame,
        })))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0 || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        hint.set_upper(u64::try_from(self.left).unwrap_or(u64::MAX));
        hint
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_long_body_is_cut_and_a_short_one_kept() {
        for (len, kept) in [(100_000, MAX_ERROR_BODY), (10, 10)] {
            let mut cut = Cut {
                inner: SdkBody::from(vec![b'x'; len]),
                left: MAX_ERROR_BODY,
            };
            let mut read = 0;
            while let Some(frame) =
                std::future::poll_fn(|cx| Pin::new(&mut cut).poll_frame(cx)).await
            {
                read += frame.unwrap().into_data().map_or(0, |d| d.len());
            }
            assert_eq!(read, kept);
        }
    }
}
