//! Block layouts: what a block's bytes mean (model, dtype, layers, tokens per block, size).
//!
//! Two blocks with the same kvgate key are interchangeable only within one layout, so every
//! block the store holds is addressed by (layout, key). Connectors register their layout once
//! per connection; the registry is bounded.

use serde::{Deserialize, Serialize};

/// A registered layout's number, dense from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayoutId(pub u32);

/// What a connector declares about its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// The served model name (the `model` of the envelopes the daemon publishes for it).
    pub model: String,
    /// Element type of the cache, e.g. `fp8` or `bf16`.
    pub dtype: String,
    /// Attention layers in a block.
    pub layers: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one block; every block offloaded under this layout has exactly this size.
    pub block_bytes: u64,
    /// The tensor-parallel shard the blocks belong to (each TP worker's connector offloads
    /// its own slice of every block): shards of one block are different blocks here.
    #[serde(default)]
    pub shard: u32,
    /// How many shards a block has (the tensor-parallel size): a block is usable, and
    /// published, once every shard of it is held.
    #[serde(default = "one")]
    pub shards: u32,
}

const fn one() -> u32 {
    1
}

/// The most tensor-parallel shards of a layout.
pub const MAX_SHARDS: u32 = 1024;

/// The most layouts one daemon holds (models × dtypes on one node).
pub const MAX_LAYOUTS: usize = 64;
/// The longest model or dtype name accepted.
pub const MAX_NAME_BYTES: usize = 256;

/// Why a layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A field is empty, zero or too long.
    #[error("invalid layout: {0}")]
    Invalid(&'static str),
    /// The registry is full.
    #[error("too many layouts (at most {MAX_LAYOUTS})")]
    Full,
    /// The daemon publishes one KV-event source per node, so every layout must be of the
    /// first one's model and block size.
    #[error(
        "this node's block manager serves model {model:?} with {block_size}-token blocks; \
         a layout of another model or block size needs its own daemon"
    )]
    OtherModel {
        /// The registered model.
        model: String,
        /// Its block size.
        block_size: u32,
    },
    /// A block is bigger than any tier.
    #[error("a block of {block_bytes} bytes does not fit in any tier (largest {largest} bytes)")]
    TooLarge {
        /// The layout's block size.
        block_bytes: u64,
        /// The largest tier's capacity.
        largest: u64,
    },
}

impl Layout {
    /// A stable hash of every field: the same on every node and across restarts, so blocks
    /// in the shared remote store are named by it.
    pub fn fingerprint(&self) -> u64 {
        let mut buf = Vec::with_capacity(self.model.len() + self.dtype.len() + 24);
        for field in [self.model.as_bytes(), self.dtype.as_bytes()] {
            buf.extend_from_slice(&(field.len() as u64).to_le_bytes());
            buf.extend_from_slice(field);
        }
        buf.extend_from_slice(&self.layers.to_le_bytes());
        buf.extend_from_slice(&self.block_size.to_le_bytes());
        buf.extend_from_slice(&self.block_bytes.to_le_bytes());
        buf.extend_from_slice(&self.shard.to_le_bytes());
        buf.extend_from_slice(&self.shards.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// The fingerprint of the layout's whole block: every field but `shard`, so all shards of
    /// one block share it.
    pub fn group(&self) -> u64 {
        Layout {
            shard: 0,
            ..self.clone()
        }
        .fingerprint()
    }

    /// Checks the fields a connector could get wrong.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let name_ok = |s: &str| !s.is_empty() && s.len() <= MAX_NAME_BYTES;
        if !name_ok(&self.model) {
            return Err(LayoutError::Invalid("model must be 1 to 256 bytes"));
        }
        if !name_ok(&self.dtype) {
            return Err(LayoutError::Invalid("dtype must be 1 to 256 bytes"));
        }
        if self.layers == 0 || self.block_size == 0 || self.block_bytes == 0 {
            return Err(LayoutError::Invalid(
                "layers, block_size and block_bytes must be positive",
            ));
        }
        if self.shards == 0 || self.shards > MAX_SHARDS || self.shard >= self.shards {
            return Err(LayoutError::Invalid(
                "shards must be 1 to 1024, and shard below it",
            ));
        }
        Ok(())
    }
}

/// The registered layouts.
#[derive(Debug, Default)]
pub(crate) struct Layouts {
    layouts: Vec<Layout>,
}

impl Layouts {
    /// The id of `layout`, registering it when new.
    pub(crate) fn register(&mut self, layout: Layout) -> Result<LayoutId, LayoutError> {
        layout.validate()?;
        if let Some(i) = self.layouts.iter().position(|l| *l == layout) {
            return Ok(LayoutId(i as u32));
        }
        if let Some(first) = self.layouts.first()
            && (first.model != layout.model || first.block_size != layout.block_size)
        {
            return Err(LayoutError::OtherModel {
                model: first.model.clone(),
                block_size: first.block_size,
            });
        }
        if self.layouts.len() >= MAX_LAYOUTS {
            return Err(LayoutError::Full);
        }
        self.layouts.push(layout);
        Ok(LayoutId((self.layouts.len() - 1) as u32))
    }

    pub(crate) fn get(&self, id: LayoutId) -> Option<&Layout> {
        self.layouts.get(id.0 as usize)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (LayoutId, &Layout)> {
        self.layouts
            .iter()
            .enumerate()
            .map(|(i, l)| (LayoutId(i as u32), l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn layout(shard: u32) -> Layout {
        Layout {
            model: "m".into(),
            dtype: "fp8".into(),
            layers: 80,
            block_size: 32,
            block_bytes: 64,
            shard,
            shards: 1024,
        }
    }

    #[test]
    fn registration_is_idempotent_and_bounded() {
        let mut l = Layouts::default();
        assert_eq!(l.register(layout(0)), Ok(LayoutId(0)));
        assert_eq!(l.register(layout(1)), Ok(LayoutId(1)));
        assert_eq!(l.register(layout(0)), Ok(LayoutId(0)));
        for i in 2..MAX_LAYOUTS {
            l.register(layout(i as u32)).unwrap();
        }
        assert_eq!(l.register(layout(999)), Err(LayoutError::Full));
        assert_eq!(l.get(LayoutId(1)).map(|l| l.shard), Some(1));
    }

    #[test]
    fn one_model_and_block_size_per_daemon() {
        let mut l = Layouts::default();
        l.register(layout(0)).unwrap();
        let mut other = layout(0);
        other.model = "other".into();
        assert!(matches!(
            l.register(other),
            Err(LayoutError::OtherModel { .. })
        ));
        let mut other = layout(0);
        other.block_size = 16;
        assert!(matches!(
            l.register(other),
            Err(LayoutError::OtherModel { .. })
        ));
        let mut bf16 = layout(0);
        bf16.dtype = "bf16".into();
        assert_eq!(l.register(bf16), Ok(LayoutId(1)));
    }

    #[test]
    fn fingerprints_are_stable_and_tell_fields_apart() {
        let a = layout(0);
        assert_eq!(a.fingerprint(), layout(0).fingerprint());
        assert_ne!(a.fingerprint(), layout(1).fingerprint(), "shards differ");
        assert_eq!(
            a.group(),
            layout(1).group(),
            "one block's shards share a group"
        );
        let mut b = layout(0);
        b.layers += 1;
        assert_ne!(a.fingerprint(), b.fingerprint());
        // Length-prefixed: moving a byte from model to dtype changes the hash.
        let (mut c, mut d) = (layout(0), layout(0));
        (c.model, c.dtype) = ("ab".into(), "c".into());
        (d.model, d.dtype) = ("a".into(), "bc".into());
        assert_ne!(c.fingerprint(), d.fingerprint());
    }

    #[test]
    fn bad_layouts_are_refused() {
        let mut bad = layout(0);
        bad.shard = bad.shards;
        assert!(bad.validate().is_err());
        bad = layout(0);
        bad.model = String::new();
        assert!(bad.validate().is_err());
        bad = layout(0);
        bad.block_bytes = 0;
        assert!(bad.validate().is_err());
        bad = layout(0);
        bad.dtype = "x".repeat(MAX_NAME_BYTES + 1);
        assert!(bad.validate().is_err());
    }
}
