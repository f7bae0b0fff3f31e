//! The tonic `ExternalProcessor` service: each `Process` stream's reply stream drives an
//! [`ExtProcStream`] and ends it whichever way the stream goes.
//!
//! Envoy's messages are handled inside the reply stream's `poll_next`, on the task that sends the
//! replies: no task or channel sits between a message and its reply, so each exchange costs one
//! wake-up less (each is on the critical path of a request, several times per request).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use crate::extproc::{ExtProcStream, Handoffs, Router, StreamConfig};

/// gRPC metadata the gateway's response-observer filter sends (`grpc_service.initial_metadata`)
/// so the EPP knows that stream is the observer's, with the value [`RESPONSE_ROLE`].
pub const ROLE_METADATA: &str = "x-kvgate-ext-proc-role";
/// [`ROLE_METADATA`]'s value on the response observer's streams.
pub const RESPONSE_ROLE: &str = "response";

/// Room above the body limit for a message's headers and framing.
const MESSAGE_OVERHEAD: usize = 1 << 20;

/// The ext_proc gRPC service over a [`Router`].
#[derive(Clone)]
pub struct ExtProcService {
    router: Arc<dyn Router>,
    config: Arc<StreamConfig>,
    /// The response-observer layout's ticket table, when the gateway runs it.
    handoffs: Option<Arc<Handoffs>>,
    /// Turns true when open streams must end now (the drain timeout passed).
    cut: watch::Receiver<bool>,
    /// Every stream is the response observer's (the observer's own port).
    observing_only: bool,
}

impl std::fmt::Debug for ExtProcService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtProcService")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ExtProcService {
    /// A service routing through `router`.
    pub fn new(router: Arc<dyn Router>, config: StreamConfig) -> Self {
        Self {
            router,
            config: Arc::new(config),
            handoffs: None,
            cut: watch::channel(false).1,
            observing_only: false,
        }
    }

    /// The same service for the response observer's own port: every stream observes
    /// responses, whatever its gRPC metadata says.
    pub fn observing_only(self) -> Self {
        Self {
            observing_only: true,
            ..self
        }
    }

    /// The same service in the response-observer layout when `handoffs` is given.
    pub fn with_handoffs(self, handoffs: Option<Arc<Handoffs>>) -> Self {
        Self { handoffs, ..self }
    }

    /// The same service, whose open streams end when `cut` turns true.
    pub(super) fn with_cut(self, cut: watch::Receiver<bool>) -> Self {
        Self { cut, ..self }
    }

    /// The tonic server for this service, accepting whole `BUFFERED` bodies up to the limit.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let max = self.config.max_body_bytes.saturating_add(MESSAGE_OVERHEAD);
        ExternalProcessorServer::new(self).max_decoding_message_size(max)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = Replies;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut state = ExtProcStream::new(Arc::clone(&self.router), Arc::clone(&self.config));
        if let Some(h) = &self.handoffs {
            state = state.with_handoffs(Arc::clone(h));
        }
        let role = request.metadata().get(ROLE_METADATA);
        if self.observing_only || role.is_some_and(|r| r.as_bytes() == RESPONSE_ROLE.as_bytes()) {
            state = state.observing_responses();
        }
        let span = tracing::info_span!(
            "ext_proc",
            request_id = tracing::field::Empty,
            endpoint = tracing::field::Empty
        );
        Ok(Response::new(Replies::new(
            request.into_inner(),
            state,
            self.cut.clone(),
            span,
        )))
    }
}

/// One `Process` stream's replies: polling it reads Envoy's next message, feeds it to the state
/// machine and yields the replies, until either side ends. The stream's ticket is closed exactly
/// once, by [`ExtProcStream::finish`]: when Envoy ends the stream, when it breaks, when the drain
/// timeout cuts it, or when tonic drops the replies (Envoy reset the stream or went away).
pub struct Replies {
    inbound: Streaming<ProcessingRequest>,
    state: Option<ExtProcStream>,
    queued: VecDeque<ProcessingResponse>,
    /// Resolves when open streams must end now.
    cut: Pin<Box<dyn Future<Output = ()> + Send>>,
    span: tracing::Span,
}

impl std::fmt::Debug for Replies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replies")
            .field("state", &self.state)
            .field("queued", &self.queued.len())
            .finish_non_exhaustive()
    }
}

impl Replies {
    fn new(
        inbound: Streaming<ProcessingRequest>,
        state: ExtProcStream,
        mut cut: watch::Receiver<bool>,
        span: tracing::Span,
    ) -> Self {
        let cut = Box::pin(async move {
            if cut.wait_for(|cut| *cut).await.is_err() {
                // Nobody can cut this stream any more.
                std::future::pending::<()>().await;
            }
        });
        Self {
            inbound,
            state: Some(state),
            queued: VecDeque::new(),
            cut,
            span,
        }
    }

    /// Ends the stream: closes its ticket; nothing more is read.
    fn close(&mut self) {
        if let Some(state) = self.state.take() {
            state.finish();
        }
    }
}

impl Stream for Replies {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let _entered = this.span.clone().entered();
        loop {
            if let Some(reply) = this.queued.pop_front() {
                return Poll::Ready(Some(Ok(reply)));
            }
            let Some(state) = this.state.as_mut() else {
                return Poll::Ready(None);
            };
            if this.cut.as_mut().poll(cx).is_ready() {
                tracing::debug!("drain timeout: stream cut");
                this.close();
                return Poll::Ready(Some(Err(Status::unavailable(
                    "endpoint picker shutting down",
                ))));
            }
            let msg = match ready!(Pin::new(&mut this.inbound).poll_next(cx)) {
                Some(Ok(msg)) => msg,
                Some(Err(status)) => {
                    tracing::debug!(code = ?status.code(), message = status.message(), "ext_proc stream broke");
                    this.close();
                    return Poll::Ready(None);
                }
                None => {
                    this.close();
                    return Poll::Ready(None);
                }
            };
            match state.on_message(msg) {
                Ok(replies) => this.queued.extend(replies),
                Err(err) => {
                    tracing::warn!(error = %err, label = err.metric_label(), "ext_proc protocol error");
                    this.close();
                    return Poll::Ready(Some(Err(Status::failed_precondition(err.to_string()))));
                }
            }
        }
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        if self.state.is_some() {
            let _entered = self.span.clone().entered();
            tracing::debug!("Envoy stopped reading replies");
            self.close();
        }
    }
}
