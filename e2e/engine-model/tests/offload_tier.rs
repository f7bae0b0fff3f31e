//! An engine with an external offloading tier: what it hands the tier, how it waits for a
//! tier's late answer, and what a load from each of the tier's levels costs.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::sync::{Arc, Mutex};

use engine_model::{
    CacheEvent, Engine, Lookup, LookupRequest, NewRequest, Offload, OffloadTier, Preset, RequestId,
    Sources, XxhChain,
};

/// One offload: (request, indices, hashes, the blocks' tokens).
type Offloaded = (RequestId, Vec<usize>, Vec<u64>, Vec<Vec<u32>>);

/// What the scripted tier saw.
#[derive(Debug, Default)]
struct Seen {
    offloads: Vec<Offloaded>,
    /// (request, first block, hashes) per lookup.
    lookups: Vec<(RequestId, usize, Vec<u64>)>,
    finished: Vec<RequestId>,
    /// (request, first block, sources) per load started.
    started: Vec<(RequestId, usize, Sources)>,
}

/// A tier that answers `Pending` `pending` times, then its scripted sources.
#[derive(Debug)]
struct Scripted {
    seen: Arc<Mutex<Seen>>,
    pending: usize,
    answer: Sources,
    block_size: usize,
    in_step: bool,
}

impl OffloadTier for Scripted {
    fn offload(&mut self, b: Offload<'_>, _events: &mut Vec<CacheEvent>) {
        let tokens = b
            .indices
            .iter()
            .map(|&i| b.tokens[i * self.block_size..(i + 1) * self.block_size].to_vec())
            .collect();
        self.seen.lock().unwrap().offloads.push((
            b.request,
            b.indices.to_vec(),
            b.hashes.to_vec(),
            tokens,
        ));
    }

    fn lookup(&mut self, r: LookupRequest<'_>) -> Lookup {
        self.seen
            .lock()
            .unwrap()
            .lookups
            .push((r.request, r.first_block, r.hashes.to_vec()));
        if self.pending > 0 {
            self.pending -= 1;
            return Lookup::Pending;
        }
        Lookup::Found(self.answer)
    }

    fn load_started(&mut self, r: LookupRequest<'_>, sources: Sources) {
        assert_eq!(r.hashes.len(), sources.blocks());
        self.seen
            .lock()
            .unwrap()
            .started
            .push((r.request, r.first_block, sources));
    }

    fn finished(&mut self, request: RequestId) {
        self.seen.lock().unwrap().finished.push(request);
    }

    fn loads_in_step(&self, _sources: &Sources) -> bool {
        self.in_step
    }

    fn clear(&mut self) {}

    fn len(&self) -> usize {
        0
    }

    fn hashes(&self) -> Vec<u64> {
        Vec::new()
    }
}

fn request(id: RequestId, prompt: Vec<u32>) -> NewRequest {
    NewRequest {
        id,
        prompt,
        output: vec![9, 9],
        hasher: Box::new(XxhChain::new(0)),
        arrival: 0,
        kv_transfer: None,
    }
}

/// Runs the engine until it is idle; returns (model time, cached tokens of the first token).
fn run(e: &mut Engine, mut now: u64, max_idle: usize) -> (u64, Option<u32>) {
    let mut cached = None;
    let mut idle = 0;
    while e.has_unfinished() {
        match e.step(now) {
            Some(s) => {
                now += s.duration;
                for o in s.outputs {
                    cached = cached.or(o.num_cached_tokens);
                }
            }
            None => {
                idle += 1;
                assert!(idle <= max_idle, "the engine stalled");
                now = e.next_wakeup().unwrap_or(now + 1);
            }
        }
    }
    (now, cached)
}

fn engine(pending: usize, answer: Sources) -> (Engine, Arc<Mutex<Seen>>) {
    tiered(pending, answer, false)
}

fn tiered(pending: usize, answer: Sources, in_step: bool) -> (Engine, Arc<Mutex<Seen>>) {
    let config = Preset::Small.config();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tier = Scripted {
        seen: Arc::clone(&seen),
        pending,
        answer,
        block_size: config.block_size as usize,
        in_step,
    };
    (Engine::with_offload(config, Box::new(tier)).unwrap(), seen)
}

#[test]
fn every_cached_block_is_offloaded_with_its_index_and_tokens_and_the_tier_hears_the_end() {
    let (mut e, seen) = engine(0, Sources::default());
    let bs = e.config().block_size as usize;
    let prompt: Vec<u32> = (0..(3 * bs as u32 + 5)).collect();
    e.add_request(request(1, prompt.clone())).unwrap();
    run(&mut e, 0, 4);
    let seen = seen.lock().unwrap();
    let indices: Vec<usize> = seen.offloads.iter().flat_map(|o| o.1.clone()).collect();
    assert_eq!(
        indices,
        [0, 1, 2],
        "the prompt's three full blocks, once each"
    );
    let tokens: Vec<u32> = seen
        .offloads
        .iter()
        .flat_map(|o| o.3.concat())
        .collect::<Vec<_>>();
    assert_eq!(tokens, prompt[..3 * bs]);
    assert_eq!(seen.lookups.len(), 1, "one lookup, past the empty GPU hit");
    assert_eq!(seen.lookups[0].1, 0);
    assert_eq!(seen.lookups[0].2.len(), 3);
    assert_eq!(seen.finished, [1]);
    assert!(seen.started.is_empty(), "nothing found, nothing loaded");
}

#[test]
fn a_pending_answer_keeps_the_request_waiting_without_blocking_the_queue() {
    let (mut e, seen) = engine(2, Sources::default());
    let bs = e.config().block_size as usize;
    e.add_request(request(1, (0..(2 * bs as u32 + 1)).collect()))
        .unwrap();
    // The request waits on its lookup, asked again on every step until answered.
    assert!(e.step(0).is_none(), "a pending lookup schedules nothing");
    assert_eq!(e.stats().waiting, 1);
    assert!(e.step(0).is_none());
    let (_, cached) = run(&mut e, 0, 2);
    assert_eq!(cached, Some(0));
    assert_eq!(
        seen.lock().unwrap().lookups.len(),
        3,
        "asked until answered"
    );
}

#[test]
fn loads_are_charged_at_each_levels_bandwidth() {
    let config = Preset::Small.config();
    let bs = config.block_size as usize;
    let block = config.kv_bytes_per_token * u64::from(config.block_size);
    let prompt: Vec<u32> = (0..(8 * bs as u32 + 1)).collect();
    let mut took = Vec::new();
    for answer in [
        Sources::default(),
        Sources {
            host: 8,
            ..Sources::default()
        },
        Sources {
            disk: 8,
            ..Sources::default()
        },
        Sources {
            host: 4,
            remote: 4,
            ..Sources::default()
        },
    ] {
        let (mut e, seen) = engine(0, answer);
        e.add_request(request(1, prompt.clone())).unwrap();
        let (end, cached) = run(&mut e, 0, 4);
        assert_eq!(cached, Some((answer.blocks() * bs) as u32));
        let started = &seen.lock().unwrap().started;
        if answer.blocks() > 0 {
            assert_eq!(started, &[(1, 0, answer)], "one load, of what was found");
        } else {
            assert!(started.is_empty());
        }
        took.push(end);
    }
    let ns = |bytes: u64, bw: u64| bytes * 1_000_000_000 / bw;
    // Loaded blocks are not computed: the same last-token prefill and decode follow each load,
    // so the runs differ by their loads alone.
    let host = ns(8 * block, config.host_load_bandwidth);
    let disk = ns(8 * block, config.disk_load_bandwidth);
    let mixed =
        ns(4 * block, config.host_load_bandwidth) + ns(4 * block, config.remote_load_bandwidth);
    let compute_rest = took[1] - host;
    assert!(took[2].abs_diff(compute_rest + disk) <= 1, "{took:?}");
    assert!(took[3].abs_diff(compute_rest + mixed) <= 1, "{took:?}");
    assert!(disk > host, "disk loads slower than host memory");
}

#[test]
fn a_tier_that_loads_in_the_step_schedules_at_once_and_the_step_takes_the_load() {
    let config = Preset::Small.config();
    let bs = config.block_size as usize;
    let block = config.kv_bytes_per_token * u64::from(config.block_size);
    let prompt: Vec<u32> = (0..(8 * bs as u32 + 1)).collect();
    let answer = Sources {
        host: 5,
        disk: 3,
        ..Sources::default()
    };
    let load = block * 5 * 1_000_000_000 / config.host_load_bandwidth
        + block * 3 * 1_000_000_000 / config.disk_load_bandwidth;

    // Waiting for the load: no step runs until it is done.
    let (mut waits, _) = tiered(0, answer, false);
    waits.add_request(request(1, prompt.clone())).unwrap();
    assert!(waits.step(0).is_none(), "the request waits for its load");
    let (waited_end, _) = run(&mut waits, 0, 4);

    // In the step: the first step loads the blocks, computes the last prompt token and
    // produces the first output token.
    let (mut e, seen) = tiered(0, answer, true);
    e.add_request(request(1, prompt.clone())).unwrap();
    let first = e.step(0).expect("the request runs in the first step");
    let out = &first.outputs[0];
    assert_eq!(
        out.new_tokens.len(),
        1,
        "the first token comes from the loading step"
    );
    assert_eq!(out.num_cached_tokens, Some((8 * bs) as u32));
    assert_eq!(out.queue_time, Some(0));
    assert!(
        first.duration > load,
        "the step takes the load and its forward pass"
    );
    assert_eq!(seen.lock().unwrap().started, [(1, 0, answer)]);
    let (end, _) = run(&mut e, first.duration, 4);
    // One request alone: the same load and the same compute, only arranged differently.
    assert!(end.abs_diff(waited_end) <= 1, "{end} vs {waited_end}");

    // A request that decodes beside it waits for the load too: its step is the loading step.
    let (mut e, _) = tiered(0, answer, true);
    e.add_request(request(2, vec![7; bs + 1])).unwrap();
    let alone = e.step(0).unwrap().duration;
    e.add_request(NewRequest {
        arrival: alone,
        ..request(1, prompt)
    })
    .unwrap();
    let both = e.step(alone).unwrap();
    assert_eq!(
        both.outputs.len(),
        2,
        "the decode and the loaded request's first token"
    );
    assert!(both.duration > load);
}

#[test]
fn an_answer_longer_than_asked_is_capped_at_the_candidates() {
    let (mut e, seen) = engine(
        0,
        Sources {
            host: 100,
            ..Sources::default()
        },
    );
    let bs = e.config().block_size as usize;
    // Two full blocks; the last token must be computed, so only one block may load.
    e.add_request(request(1, (0..(2 * bs as u32)).collect()))
        .unwrap();
    let (_, cached) = run(&mut e, 0, 4);
    assert_eq!(cached, Some(bs as u32));
    e.check_invariants().unwrap();
    assert_eq!(
        seen.lock().unwrap().started[0].2,
        Sources {
            host: 1,
            ..Sources::default()
        },
        "the load is cut to the candidates"
    );
}
