//! The HTTP API: OpenAI completions and chat (streaming and not), models, health, metrics,
//! vLLM's `/reset_prefix_cache`, and `/sim/bootstrap` (the SGLang P/D seats seen, see
//! [`super::bootstrap`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine_model::{KvTransfer, TransferParams};
use kv_events::engine_hash::Digest;
use serde_json::{Value, json};
use tokenize::{ChatOptions, TextTokenizer};
use tokio::sync::mpsc;

use super::bootstrap::{Bootstrap, DisaggMode, Seat};
use super::clock::Clock;
use super::driver::{Driver, Submit, SubmitError, Ticket, Update};
use super::metrics::{Finish, RequestTimings, SimMetrics};
use super::openai::{ApiError, ChatRequest, Common, CompletionRequest, Prompt, Usage, parse_body};
use super::output::{OutputVocab, SplitMix, output_len};
use super::publisher::PublisherStats;
use super::vllm_hash::VllmChain;

/// Everything the handlers share.
#[derive(Debug)]
pub struct App {
    /// The engine loop.
    pub driver: Driver,
    /// The served tokenizer (or the byte fallback).
    pub tokenizer: TextTokenizer,
    /// Words the output is made of.
    pub vocab: OutputVocab,
    /// Names served; the first is the default.
    pub served: Vec<String>,
    /// The underlying model name (`root` in /v1/models).
    pub root: String,
    /// vLLM's NONE_HASH for this process's PYTHONHASHSEED.
    pub none_hash: Digest,
    /// Metrics.
    pub metrics: SimMetrics,
    /// Publisher counters, when publishing.
    pub publisher: Option<Arc<PublisherStats>>,
    /// KV block manager connector counters, with `--kvbm-socket`.
    pub kvbm: Option<Arc<super::kvbm::KvbmStats>>,
    /// Pod name for the response header.
    pub pod: HeaderValue,
    /// Data-parallel rank for the response header.
    pub dp_rank: HeaderValue,
    /// `ip:port` for P/D parameters.
    pub advertise: (String, u16),
    /// Context length.
    pub max_model_len: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Mean output length without ignore_eos.
    pub mean_output_tokens: u32,
    /// Body limit.
    pub max_body_bytes: usize,
    /// Status for a full queue.
    pub queue_full: StatusCode,
    /// Faults.
    pub faults: Faults,
    /// /health answers 503 before this instant.
    pub ready_at: Instant,
    /// Request-id counter.
    pub next_id: AtomicU64,
    /// Randomness for output and faults.
    pub rng: Mutex<SplitMix>,
    /// SGLang bootstrap P/D role and rooms.
    pub bootstrap: Arc<Bootstrap>,
}

/// Fault injection settings.
#[derive(Debug, Clone)]
pub struct Faults {
    /// Fraction of requests answered with `status`.
    pub error_rate: f64,
    /// Status of injected errors.
    pub status: StatusCode,
    /// Fraction of streams stalled once.
    pub stall_rate: f64,
    /// Stall length.
    pub stall: std::time::Duration,
    /// Whether POST /sim/crash exists.
    pub crash_endpoint: bool,
}

/// The router.
pub fn router(app: Arc<App>) -> Router {
    let mut r = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/bootstrap", get(bootstrap_seen));
    if app.faults.crash_endpoint {
        r = r.route("/sim/crash", post(crash));
    }
    r.with_state(app)
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let created = unix_now();
    let data: Vec<Value> = app
        .served
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": app.root, "parent": null, "max_model_len": app.max_model_len,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn health(State(app): State<Arc<App>>) -> StatusCode {
    if Instant::now() >= app.ready_at {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn bootstrap_seen(State(app): State<Arc<App>>) -> Json<Value> {
    Json(app.bootstrap.seen_json())
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let mut text = app.metrics.render(
        &app.driver.stats(),
        app.publisher.as_deref(),
        &app.driver.lag(),
    );
    app.bootstrap.render(&mut text);
    if let Some(k) = &app.kvbm {
        k.render(&mut text);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    if app.driver.reset_prefix_cache() {
        tracing::info!("prefix cache reset");
        StatusCode::OK.into_response()
    } else {
        ApiError {
            status: StatusCode::CONFLICT,
            message: "cannot reset the prefix cache while requests hold blocks".into(),
        }
        .into_response()
    }
}

async fn crash() -> StatusCode {
    tracing::error!("crash requested through POST /sim/crash");
    std::process::abort()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// A request ready to run.
struct Prepared {
    kind: Kind,
    model: String,
    prompts: Vec<Vec<u32>>,
    max_tokens: Option<u32>,
    common: Common,
    /// SGLang bootstrap seats, one per prompt (set by [`App::rendezvous`]).
    seats: Option<Vec<Seat>>,
    /// Decode role: the tokens each prompt's room held (set by [`App::rendezvous`]).
    pulled: Option<Vec<u32>>,
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    let result = async {
        let body = read_body(&app, req).await?;
        let r: CompletionRequest = parse_body(&body)?;
        let model = app.model(r.common.model.as_deref())?;
        app.inject_fault()?;
        let prompts = match r.prompt {
            Prompt::Text(t) => vec![app.encode_prompt(&t)?],
            Prompt::Texts(ts) => ts
                .iter()
                .map(|t| app.encode_prompt(t))
                .collect::<Result<_, _>>()?,
            Prompt::Tokens(ids) => vec![ids],
            Prompt::TokenLists(lists) => lists,
        };
        Ok(Prepared {
            kind: Kind::Completion,
            model,
            prompts,
            max_tokens: Some(r.max_tokens.unwrap_or(16)),
            common: r.common,
            seats: None,
            pulled: None,
        })
    }
    .await;
    app.respond(result).await
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Response {
    let result = async {
        let body = read_body(&app, req).await?;
        let r: ChatRequest = parse_body(&body)?;
        let model = app.model(r.common.model.as_deref())?;
        app.inject_fault()?;
        if r.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty"));
        }
        let opts = ChatOptions {
            add_generation_prompt: r.add_generation_prompt.unwrap_or(!r.continue_final_message),
            continue_final_message: r.continue_final_message,
            template_kwargs: r.chat_template_kwargs.unwrap_or_default(),
            tools: r.tools,
            ..ChatOptions::default()
        };
        let ids = app
            .tokenizer
            .encode_chat(&r.messages, &opts)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(Prepared {
            kind: Kind::Chat,
            model,
            prompts: vec![ids],
            max_tokens: r.max_completion_tokens.or(r.max_tokens),
            common: r.common,
            seats: None,
            pulled: None,
        })
    }
    .await;
    app.respond(result).await
}

async fn read_body(app: &App, req: Request) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(req.into_body(), app.max_body_bytes)
        .await
        .map_err(|_| ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "request body exceeds the {} byte limit (--max-body-bytes)",
                app.max_body_bytes
            ),
        })
}

/// P/D parameters of a request.
fn kv_transfer(params: Option<&Value>, block_size: u32) -> Result<Option<KvTransfer>, ApiError> {
    let Some(p) = params else { return Ok(None) };
    if !p.is_object() {
        return Err(ApiError::bad_request(
            "kv_transfer_params must be an object",
        ));
    }
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => Err(ApiError::bad_request(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
        )),
        (true, false) => Ok(Some(KvTransfer::PrefillOnly)),
        (false, true) => {
            let blocks = p
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "kv_transfer_params: do_remote_prefill needs remote_block_ids",
                    )
                })?;
            let n = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
            Ok(Some(KvTransfer::RemotePrefill {
                num_tokens: n.saturating_mul(block_size),
            }))
        }
        (false, false) => Ok(None),
    }
}

impl App {
    fn model(&self, asked: Option<&str>) -> Result<String, ApiError> {
        match asked {
            None => Ok(self.served.first().cloned().unwrap_or_default()),
            Some(m) if self.served.iter().any(|s| s == m) => Ok(m.to_owned()),
            Some(m) => Err(ApiError::unknown_model(m)),
        }
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode_prompt(text)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }

    fn random(&self) -> f64 {
        self.rng.lock().map(|mut r| r.next_f64()).unwrap_or(1.0)
    }

    fn inject_fault(&self) -> Result<(), ApiError> {
        if self.faults.error_rate > 0.0 && self.random() < self.faults.error_rate {
            self.metrics.faults_injected.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError {
                status: self.faults.status,
                message: "injected fault (--fault-error-rate)".into(),
            });
        }
        Ok(())
    }

    fn with_pod(&self, mut resp: Response) -> Response {
        resp.headers_mut().insert("x-kvgate-pod", self.pod.clone());
        resp.headers_mut()
            .insert("x-kvgate-dp-rank", self.dp_rank.clone());
        resp
    }

    /// Reads the SGLang bootstrap seats; in the decode role, waits until every room is ready.
    async fn rendezvous(&self, mut p: Prepared) -> Result<Prepared, ApiError> {
        let c = &p.common;
        p.seats = super::bootstrap::seats(
            c.bootstrap_host.as_ref(),
            c.bootstrap_port.as_ref(),
            c.bootstrap_room.as_ref(),
            p.prompts.len(),
        )?;
        let Some(seats) = &p.seats else { return Ok(p) };
        self.bootstrap.record(seats);
        if self.bootstrap.mode == DisaggMode::Null {
            return Ok(p);
        }
        if p.common.kv_transfer_params.is_some() {
            return Err(ApiError::bad_request(
                "kv_transfer_params and bootstrap fields are exclusive",
            ));
        }
        if self.bootstrap.mode == DisaggMode::Decode {
            let mut pulled = Vec::with_capacity(seats.len());
            for seat in seats {
                pulled.push(self.bootstrap.join(seat).await?);
            }
            p.pulled = Some(pulled);
        }
        Ok(p)
    }

    /// The KV-transfer role of prompt `i`: SGLang's bootstrap role when the request has seats
    /// (and this server a disaggregation mode), else the request's NIXL parameters.
    fn transfer_of(
        &self,
        p: &Prepared,
        i: usize,
        prompt_len: u32,
        nixl: Option<KvTransfer>,
    ) -> Option<KvTransfer> {
        if p.seats.is_none() {
            return nixl;
        }
        let full_blocks = prompt_len / self.block_size.max(1) * self.block_size;
        match self.bootstrap.mode {
            DisaggMode::Null => nixl,
            DisaggMode::Prefill => Some(KvTransfer::PrefillOnly),
            DisaggMode::Decode => {
                let pulled = p.pulled.as_ref().and_then(|v| v.get(i)).copied();
                pulled.map(|n| KvTransfer::RemotePrefill {
                    num_tokens: n.min(full_blocks),
                })
            }
        }
    }

    async fn respond(self: &Arc<Self>, prepared: Result<Prepared, ApiError>) -> Response {
        let prepared = match prepared {
            Ok(p) => self.rendezvous(p).await,
            Err(e) => Err(e),
        };
        let resp = match prepared {
            Ok(p) => match self.start(p) {
                Ok(run) => run.into_response(self).await,
                Err(e) => self.reject(e),
            },
            Err(e) => self.reject(e),
        };
        self.with_pod(resp)
    }

    fn reject(&self, e: ApiError) -> Response {
        if e.status.is_client_error() && e.status != StatusCode::NOT_FOUND {
            self.metrics
                .rejected_invalid
                .fetch_add(1, Ordering::Relaxed);
        }
        e.into_response()
    }

    /// Validates and submits every prompt.
    fn start(self: &Arc<Self>, p: Prepared) -> Result<Run, ApiError> {
        if p.common.n.unwrap_or(1) != 1 {
            return Err(ApiError::bad_request("only n=1 is supported"));
        }
        if p.prompts.is_empty() {
            return Err(ApiError::bad_request("prompt must not be empty"));
        }
        let nixl = kv_transfer(p.common.kv_transfer_params.as_ref(), self.block_size)?;
        let mut tickets = Vec::with_capacity(p.prompts.len());
        let mut prompt_lens = Vec::with_capacity(p.prompts.len());
        let mut ready_rooms = Vec::with_capacity(p.prompts.len());
        for (i, prompt) in p.prompts.iter().enumerate() {
            let len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
            let transfer = self.transfer_of(&p, i, len, nixl);
            ready_rooms.push(match (transfer, p.seats.as_ref().and_then(|s| s.get(i))) {
                (Some(KvTransfer::PrefillOnly), Some(seat)) if p.pulled.is_none() => {
                    Some((seat.room, len / self.block_size.max(1) * self.block_size))
                }
                _ => None,
            });
            if len == 0 {
                return Err(ApiError::bad_request("prompt must not be empty"));
            }
            let max_tokens = p
                .max_tokens
                .unwrap_or_else(|| self.max_model_len.saturating_sub(len));
            if max_tokens == 0 && p.max_tokens.is_some() {
                return Err(ApiError::bad_request("max_tokens must be at least 1"));
            }
            if u64::from(len) + u64::from(max_tokens.max(1)) > u64::from(self.max_model_len) {
                return Err(ApiError::context_length(
                    self.max_model_len,
                    len,
                    max_tokens,
                ));
            }
            let (n_out, stop) = match transfer {
                Some(KvTransfer::PrefillOnly) => (1, false),
                _ => {
                    let mut rng = self.rng.lock().map_err(|_| internal())?;
                    output_len(
                        max_tokens,
                        p.common.ignore_eos,
                        self.mean_output_tokens,
                        &mut rng,
                    )
                }
            };
            let output = {
                let mut rng = self.rng.lock().map_err(|_| internal())?;
                self.vocab.generate(&mut rng, n_out as usize)
            };
            let ticket = self
                .driver
                .submit(Submit {
                    prompt: prompt.clone(),
                    output,
                    hasher: Box::new(VllmChain::new(self.none_hash, p.common.cache_salt.clone())),
                    salt: p.common.cache_salt.clone(),
                    kv_transfer: transfer,
                })
                .map_err(|e| self.submit_error(e))?;
            tickets.push((ticket, stop, prompt.clone()));
            prompt_lens.push(len);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match p.kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        let stall = p.common.stream
            && self.faults.stall_rate > 0.0
            && self.random() < self.faults.stall_rate;
        Ok(Run {
            kind: p.kind,
            id: format!(
                "{prefix}-{:016x}{id:016x}",
                self.none_hash.vllm_published().0
            ),
            model: p.model,
            created: unix_now(),
            stream: p.common.stream,
            options: p.common.stream_options.unwrap_or_default(),
            return_token_ids: p.common.return_token_ids,
            tickets,
            ready_rooms,
            stall,
        })
    }

    fn submit_error(&self, e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull(_) => {
                self.metrics
                    .rejected_queue_full
                    .fetch_add(1, Ordering::Relaxed);
                ApiError {
                    status: self.queue_full,
                    message: e.to_string(),
                }
            }
            SubmitError::Admit(a) => ApiError::bad_request(a.to_string()),
            SubmitError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
            },
        }
    }

    fn transfer_json(&self, t: &TransferParams) -> Value {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": t.block_ids,
            "remote_engine_id": format!("kvgate-sim-{}", self.pod.to_str().unwrap_or("sim")),
            "remote_host": self.advertise.0,
            "remote_port": self.advertise.1,
            "tp_size": 1,
        })
    }
}

/// Sets a field of a JSON object (no-op on other values).
fn set(v: &mut Value, key: &str, val: Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert(key.to_owned(), val);
    }
}

fn internal() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "internal state unavailable".into(),
    }
}

/// One choice's progress.
#[derive(Debug, Default)]
struct Choice {
    tokens: Vec<u32>,
    cached: u32,
    first_at: Option<u64>,
    queue: Option<u64>,
    last_at: Option<u64>,
    finished: bool,
    transfer: Option<TransferParams>,
}

/// Submitted requests on their way to a response.
struct Run {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    stream: bool,
    options: super::openai::StreamOptions,
    return_token_ids: bool,
    /// Per prompt: the ticket, whether it ends on EOS, the prompt ids.
    tickets: Vec<(Ticket, bool, Vec<u32>)>,
    /// Per prompt, SGLang prefill role: the room to mark ready when it finishes, with the
    /// tokens it holds.
    ready_rooms: Vec<Option<(u64, u32)>>,
    stall: bool,
}

impl Run {
    async fn into_response(self, app: &Arc<App>) -> Response {
        if self.stream {
            self.stream_response(Arc::clone(app))
        } else {
            self.collect(app).await
        }
    }

    fn finish_reason(stop: bool) -> &'static str {
        if stop { "stop" } else { "length" }
    }

    fn record(app: &App, arrival: u64, c: &Choice, stop: bool, prompt_tokens: u32) {
        let secs = |a: u64, b: u64| Clock::seconds(b.saturating_sub(a));
        let ms = |t: Option<u64>| t.map_or(-1.0, |t| t as f64 / 1e6);
        tracing::debug!(
            target: "kvgate_sim::request",
            prompt_tokens,
            cached_tokens = c.cached,
            output_tokens = c.tokens.len(),
            arrival_ms = arrival as f64 / 1e6,
            queue_ms = ms(c.queue),
            ttft_ms = ms(c.first_at.map(|t| t.saturating_sub(arrival))),
            "request finished (model time)"
        );
        app.metrics.observe_finished(
            if stop { Finish::Stop } else { Finish::Length },
            RequestTimings {
                ttft: c.first_at.map(|t| secs(arrival, t)),
                queue: c.queue.map(Clock::seconds),
                e2e: c.last_at.map_or(0.0, |t| secs(arrival, t)),
            },
        );
    }

    fn apply(app: &App, c: &mut Choice, u: &Update) {
        if let Some(cached) = u.cached {
            c.cached = cached;
        }
        if u.queue_time.is_some() {
            c.queue = u.queue_time;
        }
        if !u.tokens.is_empty() {
            if c.first_at.is_none() {
                c.first_at = Some(u.at);
            } else if let Some(prev) = c.last_at {
                app.metrics
                    .observe_itl(Clock::seconds(u.at.saturating_sub(prev)));
            }
            c.last_at = Some(u.at);
            c.tokens.extend_from_slice(&u.tokens);
        }
        if u.transfer.is_some() {
            c.transfer = u.transfer.clone();
        }
        c.finished |= u.finished;
    }

    async fn collect(mut self, app: &Arc<App>) -> Response {
        let mut choices = Vec::with_capacity(self.tickets.len());
        let (mut prompt_tokens, mut completion, mut cached) = (0u32, 0u32, 0u32);
        let mut transfer = Value::Null;
        for (index, (ticket, stop, prompt)) in self.tickets.iter_mut().enumerate() {
            let mut c = Choice::default();
            while let Some(u) = ticket.next().await {
                Self::apply(app, &mut c, &u);
            }
            if !c.finished {
                return ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: "the engine stopped before the request finished".into(),
                }
                .into_response();
            }
            Self::record(app, ticket.arrival, &c, *stop, prompt.len() as u32);
            if let Some(Some((room, n))) = self.ready_rooms.get(index) {
                app.bootstrap.room_ready(*room, *n);
            }
            prompt_tokens += prompt.len() as u32;
            completion += c.tokens.len() as u32;
            cached += c.cached;
            if let Some(t) = &c.transfer {
                transfer = app.transfer_json(t);
            }
            let text = app.vocab.text(&c.tokens);
            let reason = Self::finish_reason(*stop);
            let mut choice = match self.kind {
                Kind::Completion => json!({
                    "index": index, "text": text, "logprobs": null,
                    "finish_reason": reason, "stop_reason": null, "prompt_logprobs": null,
                }),
                Kind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text, "reasoning_content": null, "tool_calls": []},
                    "logprobs": null, "finish_reason": reason, "stop_reason": null,
                }),
            };
            if self.return_token_ids {
                set(&mut choice, "token_ids", json!(c.tokens));
                if self.kind == Kind::Completion {
                    set(&mut choice, "prompt_token_ids", json!(prompt));
                }
            }
            choices.push(choice);
        }
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let mut body = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices,
            "usage": Usage::new(prompt_tokens, completion, cached),
            "kv_transfer_params": transfer,
        });
        if self.return_token_ids && self.kind == Kind::Chat {
            set(
                &mut body,
                "prompt_token_ids",
                json!(self.tickets.first().map(|t| &t.2)),
            );
        }
        Json(body).into_response()
    }

    fn chunk(&self, index: usize, text: Option<&str>, first: bool, reason: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": index, "text": text.unwrap_or(""), "logprobs": null,
                "finish_reason": reason, "stop_reason": null,
            }),
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text.unwrap_or("")})
                } else {
                    json!({"content": text.unwrap_or("")})
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": reason, "stop_reason": null})
            }
        };
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if self.options.include_usage {
            set(&mut v, "usage", Value::Null);
        }
        v
    }

    fn stream_response(self, app: Arc<App>) -> Response {
        let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
        tokio::spawn(self.pump(app, tx));
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(body)
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    }

    /// Streams every choice's updates as SSE; stops (and so aborts the requests) when the
    /// client goes away.
    async fn pump(mut self, app: Arc<App>, tx: mpsc::Sender<Result<Bytes, Infallible>>) {
        let send = |v: &Value| {
            let line = format!("data: {v}\n\n");
            tx.send(Ok(Bytes::from(line)))
        };
        // Merge the choices' updates.
        let (mtx, mut mrx) = mpsc::unbounded_channel::<(usize, Update)>();
        let mut meta = Vec::with_capacity(self.tickets.len());
        for (index, (mut ticket, stop, prompt)) in
            std::mem::take(&mut self.tickets).into_iter().enumerate()
        {
            meta.push((ticket.arrival, stop, prompt.len() as u32));
            let mtx = mtx.clone();
            tokio::spawn(async move {
                while let Some(u) = ticket.next().await {
                    if mtx.send((index, u)).is_err() {
                        return; // the stream is gone: dropping the ticket aborts the request
                    }
                }
            });
        }
        drop(mtx);
        let mut choices: Vec<Choice> = meta.iter().map(|_| Choice::default()).collect();
        let mut stalled = !self.stall;
        while let Some((index, u)) = mrx.recv().await {
            let (Some(c), Some(&(arrival, stop, prompt_tokens))) =
                (choices.get_mut(index), meta.get(index))
            else {
                continue;
            };
            let first = c.first_at.is_none();
            Self::apply(&app, c, &u);
            if u.tokens.is_empty() && !u.finished {
                continue;
            }
            if !stalled && c.tokens.len() > 1 {
                stalled = true;
                app.metrics.stalls_injected.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(app.faults.stall).await;
            }
            let text = app.vocab.text(&u.tokens);
            let reason = u.finished.then(|| Self::finish_reason(stop));
            let mut chunk = self.chunk(index, Some(&text), first, reason);
            if u.finished {
                if let Some(t) = &c.transfer {
                    set(&mut chunk, "kv_transfer_params", app.transfer_json(t));
                }
                if self.return_token_ids
                    && let Some(choice) = chunk.get_mut("choices").and_then(|c| c.get_mut(0))
                {
                    set(choice, "token_ids", json!(c.tokens));
                }
            }
            if self.options.continuous_usage_stats {
                let pt = meta.get(index).map_or(0, |m| m.2);
                set(
                    &mut chunk,
                    "usage",
                    json!(Usage::new(pt, c.tokens.len() as u32, c.cached)),
                );
            }
            if send(&chunk).await.is_err() {
                return;
            }
            if u.finished {
                Self::record(&app, arrival, c, stop, prompt_tokens);
                if let Some(Some((room, n))) = self.ready_rooms.get(index) {
                    app.bootstrap.room_ready(*room, *n);
                }
            }
        }
        if choices.iter().any(|c| !c.finished) {
            let err = ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the engine stopped before the request finished".into(),
            };
            let _ = send(&err.body()).await;
            return;
        }
        if self.options.include_usage {
            let prompt: u32 = meta.iter().map(|m| m.2).sum();
            let completion: u32 = choices.iter().map(|c| c.tokens.len() as u32).sum();
            let cached: u32 = choices.iter().map(|c| c.cached).sum();
            let object = match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion.chunk",
            };
            let v = json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [], "usage": Usage::new(prompt, completion, cached),
            });
            if send(&v).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_transfer_params_map_to_engine_roles() {
        assert!(kv_transfer(None, 16).unwrap().is_none());
        let p = json!({"do_remote_decode": true, "do_remote_prefill": false});
        assert!(matches!(
            kv_transfer(Some(&p), 16).unwrap(),
            Some(KvTransfer::PrefillOnly)
        ));
        let p = json!({"do_remote_prefill": true, "remote_block_ids": [4, 5, 6]});
        assert!(matches!(
            kv_transfer(Some(&p), 16).unwrap(),
            Some(KvTransfer::RemotePrefill { num_tokens: 48 })
        ));
        let p = json!({"do_remote_prefill": true});
        assert!(kv_transfer(Some(&p), 16).is_err());
        let p = json!({"do_remote_prefill": true, "do_remote_decode": true});
        assert!(kv_transfer(Some(&p), 16).is_err());
        assert!(kv_transfer(Some(&json!([1])), 16).is_err());
    }
}
