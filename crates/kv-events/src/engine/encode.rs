//! Encoding of engine payloads, byte for byte as each engine writes them.
//!
//! Used by the engine simulator and by tests. The layouts follow `msgspec` with each engine's
//! struct options: vLLM ≤ 0.23 `array_like=True` (every field present, nil where None); vLLM
//! ≥ 0.24 tagged maps with `omit_defaults=True` (required fields always present); SGLang tagged
//! maps with its own field set and signed hashes.

use super::{BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, RawValue};
use crate::msgpack::Writer;
use crate::tier::Medium;

/// Which engine's layout to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireFormat {
    /// vLLM ≤ 0.23: events as positional arrays `["BlockStored", …]`.
    VllmArray,
    /// vLLM ≥ 0.24: events as maps with a `"type"` key.
    VllmMap,
    /// SGLang: maps with a `"type"` key, signed hashes, `medium` omitted when absent.
    Sglang,
}

/// Encodes a batch as the chosen engine would publish it.
pub fn encode_batch(batch: &EventBatch, format: WireFormat) -> Vec<u8> {
    let mut w = Writer::new();
    w.array(if batch.dp_rank.is_some() { 3 } else { 2 });
    w.f64(batch.ts);
    w.array(batch.events.len());
    for event in &batch.events {
        Encoder { w: &mut w, format }.event(event);
    }
    if let Some(rank) = batch.dp_rank {
        w.int(rank);
    }
    w.into_inner()
}

struct Encoder<'w> {
    w: &'w mut Writer,
    format: WireFormat,
}

impl Encoder<'_> {
    fn event(&mut self, event: &EngineEvent) {
        match event {
            EngineEvent::BlockStored(s) => self.stored(s),
            EngineEvent::BlockRemoved(r) => self.removed(r),
            EngineEvent::AllBlocksCleared => self.tagged(0, "AllBlocksCleared"),
            EngineEvent::Unknown { type_name } => self.tagged(0, type_name),
        }
    }

    /// Starts an event with `fields` fields after the tag.
    fn tagged(&mut self, fields: usize, tag: &str) {
        match self.format {
            WireFormat::VllmArray => self.w.array(fields + 1),
            WireFormat::VllmMap | WireFormat::Sglang => {
                self.w.map(fields + 1);
                self.w.str("type");
            }
        }
        self.w.str(tag);
    }

    fn key(&mut self, name: &str) {
        if self.format != WireFormat::VllmArray {
            self.w.str(name);
        }
    }

    fn stored(&mut self, s: &BlockStored) {
        let optional = match self.format {
            // 11 fields, all present in the array layout.
            WireFormat::VllmArray => 4,
            WireFormat::VllmMap => [
                s.extra_keys.is_some(),
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
            ]
            .iter()
            .filter(|&&b| b)
            .count(),
            WireFormat::Sglang => [
                s.medium.is_some(),
                s.cache_salt.is_some(),
                s.lora_name.is_some(),
            ]
            .iter()
            .filter(|&&b| b)
            .count(),
        };
        let required = match self.format {
            WireFormat::VllmArray | WireFormat::VllmMap => 7,
            WireFormat::Sglang => 5,
        };
        self.tagged(required + optional, "BlockStored");
        self.key("block_hashes");
        self.hashes(&s.block_hashes);
        self.key("parent_block_hash");
        match s.parent_block_hash {
            Some(h) => self.hash(h),
            None => self.w.nil(),
        }
        self.key("token_ids");
        self.w.array(s.token_ids.len());
        for &t in &s.token_ids {
            self.w.uint(u64::from(t));
        }
        self.key("block_size");
        self.w.uint(u64::from(s.block_size));
        self.key("lora_id");
        self.opt_int(s.lora_id);
        if self.format == WireFormat::Sglang {
            if let Some(m) = s.medium {
                self.key("medium");
                self.w.str(m.as_str());
            }
            if let Some(salt) = &s.cache_salt {
                self.key("cache_salt");
                self.w.str(salt);
            }
            if let Some(name) = &s.lora_name {
                self.key("lora_name");
                self.w.str(name);
            }
            return;
        }
        self.key("medium");
        self.opt_medium(s.medium);
        self.key("lora_name");
        self.opt_str(s.lora_name.as_deref());
        let all = self.format == WireFormat::VllmArray;
        if all || s.extra_keys.is_some() {
            self.key("extra_keys");
            self.extra_keys(s.extra_keys.as_deref());
        }
        if all || s.group_idx.is_some() {
            self.key("group_idx");
            self.opt_int(s.group_idx);
        }
        if all || s.kv_cache_spec_kind.is_some() {
            self.key("kv_cache_spec_kind");
            self.opt_str(s.kv_cache_spec_kind.as_deref());
        }
        if all || s.kv_cache_spec_sliding_window.is_some() {
            self.key("kv_cache_spec_sliding_window");
            self.opt_int(s.kv_cache_spec_sliding_window);
        }
    }

    fn removed(&mut self, r: &BlockRemoved) {
        match self.format {
            WireFormat::VllmArray => {
                self.tagged(3, "BlockRemoved");
                self.hashes(&r.block_hashes);
                self.opt_medium(r.medium);
                self.opt_int(r.group_idx);
            }
            WireFormat::VllmMap => {
                self.tagged(2 + usize::from(r.group_idx.is_some()), "BlockRemoved");
                self.key("block_hashes");
                self.hashes(&r.block_hashes);
                self.key("medium");
                self.opt_medium(r.medium);
                if let Some(g) = r.group_idx {
                    self.key("group_idx");
                    self.w.int(g);
                }
            }
            WireFormat::Sglang => {
                self.tagged(1 + usize::from(r.medium.is_some()), "BlockRemoved");
                self.key("block_hashes");
                self.hashes(&r.block_hashes);
                if let Some(m) = r.medium {
                    self.key("medium");
                    self.w.str(m.as_str());
                }
            }
        }
    }

    fn hash(&mut self, h: EngineHash) {
        match self.format {
            WireFormat::Sglang => self.w.int(h.as_i64()),
            WireFormat::VllmArray | WireFormat::VllmMap => self.w.uint(h.0),
        }
    }

    fn hashes(&mut self, hashes: &[EngineHash]) {
        self.w.array(hashes.len());
        for &h in hashes {
            self.hash(h);
        }
    }

    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.w.int(v),
            None => self.w.nil(),
        }
    }

    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.w.str(v),
            None => self.w.nil(),
        }
    }

    fn opt_medium(&mut self, m: Option<Medium>) {
        self.opt_str(m.map(Medium::as_str));
    }

    fn extra_keys(&mut self, keys: Option<&[Option<RawValue>]>) {
        let Some(keys) = keys else {
            self.w.nil();
            return;
        };
        self.w.array(keys.len());
        for key in keys {
            match key {
                Some(raw) => self.w.raw(&raw.0),
                None => self.w.nil(),
            }
        }
    }
}
