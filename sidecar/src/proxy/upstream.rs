//! The HTTP/1.1 client used for both the local engine and remote prefillers (pooled
//! keep-alive connections, `TCP_NODELAY`).

use std::time::Duration;

use axum::body::Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The upstream client.
pub type Upstream = Client<HttpConnector, Body>;

/// A client whose connection attempts give up after `connect_timeout`.
pub fn client(connect_timeout: Duration) -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector)
}
