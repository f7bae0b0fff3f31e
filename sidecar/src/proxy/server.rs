//! The proxy's listener: binds first (so callers learn the address and port clashes surface
//! before anything is served), then serves until the shutdown future completes and every open
//! response has finished. Once shutdown begins the listener is closed, so new connections are
//! refused while in-flight streams run to their end.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::serve::ListenerExt as _;
use tokio::net::TcpListener;

use super::handler::{ProxyState, handle};

/// A bound, not yet serving, proxy.
#[derive(Debug)]
pub struct BoundProxy {
    listener: TcpListener,
    state: Arc<ProxyState>,
}

/// Binds the proxy's port.
pub async fn bind(addr: SocketAddr, state: Arc<ProxyState>) -> std::io::Result<BoundProxy> {
    let listener = TcpListener::bind(addr).await?;
    Ok(BoundProxy { listener, state })
}

impl BoundProxy {
    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` completes and the open connections have finished.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let app = Router::new().fallback(handle).with_state(self.state);
        let listener = self.listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    }
}
