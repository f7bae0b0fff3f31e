//! The tonic `ExternalProcessor` service: one task per `Process` stream drives an
//! [`ExtProcStream`] and ends it whichever way the stream goes.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use crate::extproc::{ExtProcStream, Router, StreamConfig};

/// Replies buffered per stream before the stream task waits for Envoy to read.
const REPLY_BUFFER: usize = 32;

/// Room above the body limit for a message's headers and framing.
const MESSAGE_OVERHEAD: usize = 1 << 20;

/// The ext_proc gRPC service over a [`Router`].
#[derive(Clone)]
pub struct ExtProcService {
    router: Arc<dyn Router>,
    config: Arc<StreamConfig>,
    /// Turns true when open streams must end now (the drain timeout passed).
    cut: watch::Receiver<bool>,
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
            cut: watch::channel(false).1,
        }
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
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(REPLY_BUFFER);
        let state = ExtProcStream::new(Arc::clone(&self.router), Arc::clone(&self.config));
        let span = tracing::info_span!(
            "ext_proc",
            request_id = tracing::field::Empty,
            endpoint = tracing::field::Empty
        );
        tokio::spawn(drive(inbound, tx, state, self.cut.clone()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Feeds Envoy's messages to the state machine and its replies back, until either side ends;
/// then closes the stream's ticket (exactly once, by [`ExtProcStream::finish`]).
async fn drive(
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    mut state: ExtProcStream,
    mut cut: watch::Receiver<bool>,
) {
    let cut = async move {
        if cut.wait_for(|cut| *cut).await.is_err() {
            // Nobody can cut this stream any more.
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(cut);
    'stream: loop {
        let msg = tokio::select! {
            msg = inbound.message() => msg,
            () = &mut cut => {
                tracing::debug!("drain timeout: stream cut");
                let _ = tx.try_send(Err(Status::unavailable("endpoint picker shutting down")));
                break;
            }
            () = tx.closed() => {
                tracing::debug!("Envoy stopped reading replies");
                break;
            }
        };
        let msg = match msg {
            Ok(Some(msg)) => msg,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(code = ?status.code(), message = status.message(), "ext_proc stream broke");
                break;
            }
        };
        match state.on_message(msg) {
            Ok(replies) => {
                for reply in replies {
                    if tx.send(Ok(reply)).await.is_err() {
                        break 'stream;
                    }
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, label = err.metric_label(), "ext_proc protocol error");
                // The receiver may be gone already; the stream ends either way.
                let _ = tx
                    .send(Err(Status::failed_precondition(err.to_string())))
                    .await;
                break;
            }
        }
    }
    state.finish();
}
