//! NATS ingestion against a real `nats-server`: a fake sidecar publishes envelopes and answers
//! snapshot requests; the EPP's index follows it through gaps, new epochs and a NATS outage
//! (during which the picker keeps routing); two EPP replicas share in-flight load and forget a
//! silent peer, and relay observed responses to the replica that routed them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_events::envelope::{ENVELOPE_VERSION, EngineKind};
use kv_events::load::LoadSample;
use kv_events::snapshot::{Snapshot, SnapshotRequest, TierKeys};
use kv_events::{BlockKey, Envelope, KvEvent, Source, Tier, subject};
use kv_index::{EndpointId, IndexConfig, KvIndex, Millis};
use kv_sync::SyncConfig;
use kvgate_epp::discovery::Datastore;
use kvgate_epp::discovery::apply::NodeIds;
use kvgate_epp::extproc::{
    ExtProcStream, Handoffs, REPLICA_HEADER, Relay, ResponseEvent, StreamConfig,
};
use kvgate_epp::extproc::{Router as _, RoutingInput};
use kvgate_epp::ingest::nats::{
    NatsConfig, NatsIngest, RelayConfig, Shared, SharingConfig, relay_queue,
};
use kvgate_epp::routing::keys::Keyer;
use kvgate_epp::routing::picker::Picker;
use scheduler::{Endpoint, InflightTracker, LoadBook, Scheduler, SchedulerConfig};
use tokio_stream::StreamExt as _;

mod support;

const SERVER: &str = "/usr/sbin/nats-server";
const NS: &str = "ns";
const POOL: &str = "pool";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `nats-server` child process, killed on drop.
struct NatsServer {
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts one. A missing binary fails the test: `scripts/bootstrap.sh` installs it.
    fn start() -> Self {
        assert!(
            Path::new(SERVER).exists(),
            "{SERVER} is missing: run scripts/bootstrap.sh (it installs Debian's nats-server)"
        );
        let mut s = Self {
            port: free_port(),
            child: None,
        };
        s.restart();
        s
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn restart(&mut self) {
        let child = Command::new(SERVER)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn source(pod: &str) -> Source {
    Source {
        namespace: NS.into(),
        pool: Some(POOL.into()),
        pod: Some(pod.into()),
        ip: Some(
            if pod == "pod-0" {
                "127.0.0.1"
            } else {
                "10.9.9.9"
            }
            .into(),
        ),
        port: Some(8000),
        dp_rank: 0,
        node: None,
        model: "m".into(),
        engine: EngineKind::Sim,
        block_size: 4,
    }
}

fn stored(keys: &[u64]) -> KvEvent {
    KvEvent::Stored {
        keys: keys.iter().copied().map(BlockKey).collect(),
        parent: None,
        tier: Tier::Gpu,
        lora: None,
        token_count: 4 * keys.len() as u32,
    }
}

#[derive(Debug)]
struct SidecarState {
    epoch: u64,
    seq: u64,
    resident: BTreeSet<u64>,
}

/// A fake sidecar: publishes envelopes and answers snapshot requests with 2-key chunks.
struct Sidecar {
    client: async_nats::Client,
    source: Source,
    state: Arc<Mutex<SidecarState>>,
}

impl Sidecar {
    async fn start(url: &str, pod: &str) -> Self {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .reconnect_delay_callback(|_| Duration::from_millis(100))
            .connect(url)
            .await
            .unwrap();
        let source = source(pod);
        let state = Arc::new(Mutex::new(SidecarState {
            epoch: 100,
            seq: 0,
            resident: BTreeSet::new(),
        }));
        let mut requests = client
            .subscribe(subject::snapshot(NS, POOL, pod))
            .await
            .unwrap();
        let (c, st, src) = (client.clone(), Arc::clone(&state), source.clone());
        tokio::spawn(async move {
            while let Some(msg) = requests.next().await {
                let (Some(reply), Ok(req)) = (msg.reply, SnapshotRequest::decode(&msg.payload))
                else {
                    continue;
                };
                let snap = {
                    let s = st.lock().unwrap();
                    Snapshot {
                        source: src.clone(),
                        epoch: s.epoch,
                        next_seq: s.seq,
                        tiers: vec![TierKeys {
                            tier: Tier::Gpu,
                            keys: s.resident.iter().copied().map(BlockKey).collect(),
                        }],
                    }
                };
                assert_eq!(req.dp_rank, 0);
                for chunk in snap.into_chunks(2) {
                    let _ = c
                        .publish(reply.clone(), chunk.encode().unwrap().into())
                        .await;
                }
            }
        });
        client.flush().await.unwrap();
        Self {
            client,
            source,
            state,
        }
    }

    /// Stores `keys`: published, or (when `lost`) only taken into the state, as if the
    /// envelope never reached the EPPs.
    async fn store(&self, keys: &[u64], lost: bool) {
        let env = {
            let mut s = self.state.lock().unwrap();
            s.resident.extend(keys);
            let env = Envelope {
                v: ENVELOPE_VERSION,
                source: self.source.clone(),
                epoch: s.epoch,
                seq: s.seq,
                events: vec![stored(keys)],
            };
            s.seq += 1;
            env
        };
        if !lost {
            let pod = self.source.pod.as_deref().unwrap();
            self.client
                .publish(subject::kv(NS, POOL, pod), env.encode().unwrap().into())
                .await
                .unwrap();
            self.client.flush().await.unwrap();
        }
    }

    /// A sidecar restart: new epoch, seq from 0, the engine's cache emptied.
    fn restart(&self, epoch: u64) {
        let mut s = self.state.lock().unwrap();
        s.epoch = epoch;
        s.seq = 0;
        s.resident.clear();
    }

    fn resident(&self) -> BTreeSet<u64> {
        self.state.lock().unwrap().resident.clone()
    }
}

/// One EPP's routing state.
struct Epp {
    index: Arc<KvIndex>,
    loads: Arc<LoadBook>,
    inflight: Arc<InflightTracker>,
    datastore: Arc<Datastore>,
    endpoint: EndpointId,
    epoch: Instant,
}

impl Epp {
    /// Knows `pod-0:8000`; `skew` dummy endpoints first make its id differ between EPPs.
    fn new(skew: usize) -> Self {
        let datastore = Arc::new(Datastore::new());
        let mut eps = Vec::new();
        for i in 0..skew {
            let key = (format!("other-{i}"), 9000);
            let id = datastore.id_for(&key);
            eps.push((
                key,
                Endpoint::new(id, format!("127.0.0.2:{}", 9000 + i).parse().unwrap()),
            ));
        }
        let key = ("pod-0".to_owned(), 8000);
        let endpoint = datastore.id_for(&key);
        eps.push((
            key,
            Endpoint::new(endpoint, "127.0.0.1:8000".parse().unwrap()),
        ));
        datastore.replace(eps);
        Self {
            index: Arc::new(KvIndex::new(IndexConfig::default()).unwrap()),
            loads: Arc::new(LoadBook::new()),
            inflight: Arc::new(InflightTracker::new()),
            datastore,
            endpoint,
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> Millis {
        Millis(self.epoch.elapsed().as_millis() as u64)
    }

    async fn start(&self, url: &str, sharing: Option<SharingConfig>) -> NatsIngest {
        self.start_relaying(url, sharing, None).await
    }

    async fn start_relaying(
        &self,
        url: &str,
        sharing: Option<SharingConfig>,
        relay: Option<RelayConfig>,
    ) -> NatsIngest {
        let epoch = self.epoch;
        let config = NatsConfig {
            url: url.to_owned(),
            namespace: NS.into(),
            pool: POOL.into(),
            sync: SyncConfig {
                snapshot_timeout: Millis(1_000),
                retry_initial: Millis(50),
                retry_max: Millis(500),
                ..SyncConfig::default()
            },
            limits: Default::default(),
            sharing,
        };
        let shared = Shared {
            index: Arc::clone(&self.index),
            loads: Arc::clone(&self.loads),
            inflight: Arc::clone(&self.inflight),
            datastore: Arc::clone(&self.datastore),
            nodes: Arc::new(NodeIds::default()),
            model: Arc::from("m"),
            clock: Arc::new(move || Millis(epoch.elapsed().as_millis() as u64)),
        };
        NatsIngest::start_with_relay(config, shared, relay)
            .await
            .unwrap()
    }

    /// The keys of `universe` the index holds for pod-0 on GPU.
    fn held(&self, universe: &[u64]) -> BTreeSet<u64> {
        universe
            .iter()
            .copied()
            .filter(|k| {
                self.index.find_matches(&[BlockKey(*k)], &[self.endpoint])[0].reach(Tier::Gpu) == 1
            })
            .collect()
    }

    fn picker(&self) -> Picker {
        Picker::new(
            Keyer::new(4, kv_events::key::SaltStyle::VllmExtraKey, "m"),
            Scheduler::new(SchedulerConfig::default(), 3).unwrap(),
            Arc::clone(&self.index),
            Arc::clone(&self.inflight),
            Arc::clone(&self.loads),
            Arc::clone(&self.datastore),
        )
    }
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const UNIVERSE: [u64; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_gaps_and_new_epochs_converge_to_the_sidecar() {
    let server = NatsServer::start();
    let epp = Epp::new(0);
    let nats = epp.start(&server.url(), None).await;
    let stats = nats.stats();
    let sidecar = Sidecar::start(&server.url(), "pod-0").await;
    eventually("connected", || stats.connected.load(Ordering::Relaxed) == 1).await;

    // First sight: a snapshot, then live envelopes.
    sidecar.store(&[1, 2], false).await;
    eventually("first events", || epp.held(&UNIVERSE) == sidecar.resident()).await;
    sidecar.store(&[3], false).await;
    eventually("in-order events", || {
        epp.held(&UNIVERSE) == sidecar.resident()
    })
    .await;
    assert!(stats.snapshots_ok.load(Ordering::Relaxed) >= 1);

    // A lost envelope: the next one shows a gap, a snapshot repairs it.
    sidecar.store(&[4, 5], true).await;
    sidecar.store(&[6], false).await;
    eventually("gap repaired", || epp.held(&UNIVERSE) == sidecar.resident()).await;
    assert_eq!(epp.held(&UNIVERSE), [1, 2, 3, 4, 5, 6].into());
    assert!(stats.gaps.load(Ordering::Relaxed) >= 1);

    // A sidecar restart with an emptied engine: the new epoch resyncs to exactly its set.
    sidecar.restart(777);
    sidecar.store(&[7], false).await;
    eventually("new epoch", || epp.held(&UNIVERSE) == [7].into()).await;
    assert!(stats.new_epochs.load(Ordering::Relaxed) >= 1);
    eventually("no stale source", || {
        stats.stale_sources.load(Ordering::Relaxed) == 0
    })
    .await;

    // Load samples land in the load book, stamped on the EPP's clock.
    let sample = LoadSample {
        v: ENVELOPE_VERSION,
        source: source("pod-0"),
        unix_ms: 1,
        waiting: 4,
        running: 2,
        kv_usage: 0.5,
    };
    sidecar
        .client
        .publish(
            subject::load(NS, POOL, "pod-0"),
            sample.encode().unwrap().into(),
        )
        .await
        .unwrap();
    eventually("load sample", || {
        epp.loads
            .fresh(epp.endpoint, epp.now(), Millis(5_000))
            .is_some_and(|l| l.waiting == 4)
    })
    .await;

    // A pod discovery does not know is counted and ignored.
    let stranger = Sidecar::start(&server.url(), "pod-x").await;
    stranger.store(&[12], false).await;
    eventually("unknown source counted", || {
        stats.unknown_sources.load(Ordering::Relaxed) >= 1
    })
    .await;
    assert!(!epp.held(&UNIVERSE).contains(&12));
    let text = {
        let mut s = String::new();
        stats.render_into("pool=\"pool\"", &mut s);
        s
    };
    assert!(
        text.contains("kvgate_epp_nats_connected{pool=\"pool\"} 1"),
        "{text}"
    );
    nats.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_keeps_routing_and_resyncs_after_reconnect() {
    let mut server = NatsServer::start();
    let epp = Epp::new(0);
    let nats = epp.start(&server.url(), None).await;
    let stats = nats.stats();
    let picker = epp.picker();
    let sidecar = Sidecar::start(&server.url(), "pod-0").await;
    eventually("connected", || stats.connected.load(Ordering::Relaxed) == 1).await;
    sidecar.store(&[1, 2], false).await;
    eventually("events", || epp.held(&UNIVERSE) == sidecar.resident()).await;

    server.kill();
    eventually("disconnected", || {
        stats.connected.load(Ordering::Relaxed) == 0
    })
    .await;
    // The request path answers from the cached state while NATS is down.
    let body = br#"{"model":"m","prompt":"hello hello hello hello"}"#;
    let started = Instant::now();
    let d = picker
        .route(RoutingInput {
            method: "POST",
            path: "/v1/completions",
            headers: &[],
            body: Some(body),
            subset: None,
            request_id: Some("r"),
            trace: &otel::RequestSpan::none(),
        })
        .unwrap();
    assert_eq!(d.endpoints[0], "127.0.0.1:8000");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(epp.held(&UNIVERSE), [1, 2].into(), "cached state kept");
    // What the sidecar stores while NATS is down never reaches the EPP.
    sidecar.store(&[3, 4], true).await;

    server.restart();
    eventually("reconnected", || {
        stats.connected.load(Ordering::Relaxed) == 1 && stats.connects.load(Ordering::Relaxed) >= 2
    })
    .await;
    // The reconnect resyncs every source, so the lost envelope's keys arrive by snapshot.
    eventually("resynced", || epp.held(&UNIVERSE) == [1, 2, 3, 4].into()).await;
    sidecar.store(&[5], false).await;
    eventually("live again", || epp.held(&UNIVERSE) == sidecar.resident()).await;
    nats.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_inflight_load_and_forget_a_silent_peer() {
    let server = NatsServer::start();
    let sharing = |replica| SharingConfig {
        heartbeat: Duration::from_millis(200),
        expiry: Duration::from_millis(800),
        ..SharingConfig::new(replica)
    };
    let (a, b) = (Epp::new(0), Epp::new(3));
    assert_ne!(
        a.endpoint, b.endpoint,
        "ids are process-local; names are shared"
    );
    let na = a.start(&server.url(), Some(sharing(1))).await;
    let nb = b.start(&server.url(), Some(sharing(2))).await;
    let (sa, sb) = (na.stats(), nb.stats());
    eventually("peers seen", || {
        sa.peer_replicas.load(Ordering::Relaxed) == 1
            && sb.peer_replicas.load(Ordering::Relaxed) == 1
    })
    .await;

    let t = a.inflight.on_routed(a.endpoint, 10, 4, 2);
    eventually("B sees A's routed request", || {
        let l = b.inflight.load(b.endpoint);
        l.requests == 1 && l.prefill_blocks == 4
    })
    .await;
    assert!(b.inflight.is_empty(), "B's own state stays empty");
    a.inflight.on_first_token(t);
    eventually("B sees A's first token", || {
        let l = b.inflight.load(b.endpoint);
        l.prefill_blocks == 0 && l.decode_blocks == 12
    })
    .await;
    let u = b.inflight.on_routed(b.endpoint, 2, 2, 0);
    eventually("A sees B's request", || {
        a.inflight.load(a.endpoint).requests == 2
    })
    .await;
    a.inflight.on_finished(t);
    eventually("B sees A's finish", || {
        b.inflight.load(b.endpoint).requests == 1
    })
    .await;
    // Each change went out (as deltas, or folded into a full state when one was due).
    assert!(sa.inflight_messages_sent.load(Ordering::Relaxed) >= 3);

    // A routes again and then falls silent (a crash: no goodbye); B drops its load.
    a.inflight.on_routed(a.endpoint, 8, 8, 0);
    eventually("B sees the second request", || {
        b.inflight.load(b.endpoint).requests == 2
    })
    .await;
    drop(na);
    eventually("A forgotten", || b.inflight.load(b.endpoint).requests == 1).await;
    assert!(sb.peers_expired.load(Ordering::Relaxed) >= 1);
    assert_eq!(sb.peer_replicas.load(Ordering::Relaxed), 0);

    // A clean shutdown says goodbye: B forgets C at once, not by expiry.
    let c = Epp::new(1);
    let nc = c.start(&server.url(), Some(sharing(3))).await;
    eventually("C seen", || sb.peer_replicas.load(Ordering::Relaxed) == 1).await;
    c.inflight.on_routed(c.endpoint, 4, 4, 0);
    eventually("B sees C's request", || {
        b.inflight.load(b.endpoint).requests == 2
    })
    .await;
    let expired = sb.peers_expired.load(Ordering::Relaxed);
    nc.shutdown().await;
    eventually("C gone", || b.inflight.load(b.endpoint).requests == 1).await;
    assert_eq!(
        sb.peers_expired.load(Ordering::Relaxed),
        expired,
        "by goodbye, not expiry"
    );

    b.inflight.on_finished(u);
    assert!(b.inflight.is_empty());
    nb.shutdown().await;
}

/// One replica's relay: its handoff table and the loop's config.
fn relaying(replica: u64) -> (Arc<Handoffs>, RelayConfig) {
    let (sink, outbox) = relay_queue(256);
    let relay = Relay::new(replica, Arc::new(sink), 256);
    let handoffs = Arc::new(Handoffs::new(256).with_relay(Arc::new(relay)));
    let config = RelayConfig {
        heartbeat: Duration::from_millis(200),
        ..RelayConfig::new(Arc::clone(&handoffs), outbox)
    };
    (handoffs, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_observer_relays_the_response_and_its_death_aborts_the_ticket() {
    let server = NatsServer::start();
    let (a, b) = (Epp::new(0), Epp::new(1));
    let (ha, ra) = relaying(0xa);
    let (hb, rb) = relaying(0xb);
    let na = a.start_relaying(&server.url(), None, Some(ra)).await;
    let nb = b.start_relaying(&server.url(), None, Some(rb)).await;
    let (sa, sb) = (na.stats(), nb.stats());
    eventually("both connected", || {
        sa.connected.load(Ordering::Relaxed) == 1 && sb.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    // The subscriptions are in place once a round trip through the server has been made.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (router_a, router_b) = (
        support::FakeRouter::picking(&["10.0.0.1:8000"]),
        support::FakeRouter::picking(&["10.0.0.2:8000"]),
    );
    let config = Arc::new(StreamConfig::default());
    let route = |request_id: &str| {
        let mut routing = ExtProcStream::new(router_a.clone(), Arc::clone(&config))
            .with_handoffs(Arc::clone(&ha));
        let out = routing
            .on_message(support::req_headers(
                &[
                    (":method", "GET"),
                    (":path", "/v1/models"),
                    ("x-request-id", request_id),
                ],
                true,
                None,
            ))
            .unwrap();
        routing.finish();
        support::set_headers(&out[0])
            .remove(REPLICA_HEADER)
            .expect("the pick names its replica")
    };
    let observe = |request_id: &str, replica: &str| {
        let mut observer = ExtProcStream::new(router_b.clone(), Arc::clone(&config))
            .with_handoffs(Arc::clone(&hb))
            .observing_responses();
        observer
            .on_message(support::req_headers(
                &[("x-request-id", request_id), (REPLICA_HEADER, replica)],
                false,
                None,
            ))
            .unwrap();
        assert!(observer.has_open_ticket());
        observer
    };
    let events = |r: &support::FakeRouter| r.events();

    // Routed by A, observed by B: A's router hears the response.
    let replica = route("one");
    assert_eq!(replica, "000000000000000a");
    let mut observer = observe("one", &replica);
    eventually("A's ticket claimed by B", || ha.stats().relayed == 1).await;
    observer
        .on_message(support::resp_headers("200", "application/json", None))
        .unwrap();
    observer
        .on_message(support::resp_body(b"{}", true))
        .unwrap();
    observer.finish();
    eventually("the end relayed to A", || events(&router_a).len() == 3).await;
    assert!(matches!(
        events(&router_a)[0],
        (1, ResponseEvent::Headers { status: 200, .. })
    ));
    assert_eq!(events(&router_a)[1], (1, ResponseEvent::FirstByte));
    assert_eq!(events(&router_a)[2], (1, ResponseEvent::End));
    assert!(events(&router_b).is_empty());
    assert_eq!(ha.stats().relayed, 0);

    // B dies while it observes a second request: A aborts the ticket once B is silent long
    // enough (A's sweeps run once a second in the EPP; here by hand).
    let replica = route("two");
    let observer = observe("two", &replica);
    eventually("the second claim", || ha.stats().relayed == 1).await;
    drop(nb);
    std::mem::forget(observer);
    // Let B's last heartbeat land before A's sweeps start counting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..=kvgate_epp::extproc::RELAY_SILENCE_SWEEPS {
        ha.sweep();
    }
    assert_eq!(events(&router_a).last(), Some(&(2, ResponseEvent::Aborted)));
    assert_eq!(ha.stats().relay_lost, 1);
}
