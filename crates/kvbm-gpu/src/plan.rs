//! Which strided copies move a batch of blocks between the device and host slots (pure).
//!
//! A batch maps engine blocks to host slots. Per layer and plane, a run of consecutive engine
//! blocks going to consecutive host slots is one 2-D copy: `height` rows of
//! `plane_block_bytes`, at a pitch of `plane_block_bytes` on the device (the blocks are
//! adjacent in the plane) and of `block_bytes` in host memory (one row per slot). So a batch
//! costs `layers × planes × runs` copies rather than `layers × planes × blocks`, and the
//! copies of one layer can be followed by an event the engine waits on before that layer's
//! attention (layer-wise loading).

use crate::layout::DeviceLayout;

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device → host (offload).
    ToHost,
    /// Host → device (onboard).
    ToDevice,
}

/// One engine block and the host slot it is copied to or from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockPair {
    /// The engine's block id.
    pub device_block: u32,
    /// The slot in the host buffer.
    pub host_slot: u32,
}

/// One 2-D copy: `height` rows of `width` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    /// The layer the copy belongs to.
    pub layer: u32,
    /// The device address of the first row.
    pub device: u64,
    /// Bytes between rows on the device.
    pub device_pitch: u64,
    /// The host buffer offset of the first row.
    pub host: u64,
    /// Bytes between rows in the host buffer.
    pub host_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub height: u32,
}

impl Copy2d {
    /// Bytes moved (saturating: a copy that large is refused by the movers' bounds checks).
    pub fn bytes(&self) -> u64 {
        self.width.saturating_mul(u64::from(self.height))
    }

    /// One past the last host byte the copy touches; `None` when that overflows a `u64` (a
    /// copy no mover can do).
    pub fn host_end(&self) -> Option<u64> {
        end(self.host, self.host_pitch, self.width, self.height)
    }

    /// One past the last device byte the copy touches; `None` when that overflows a `u64`.
    pub fn device_end(&self) -> Option<u64> {
        end(self.device, self.device_pitch, self.width, self.height)
    }
}

fn end(start: u64, pitch: u64, width: u64, height: u32) -> Option<u64> {
    pitch
        .checked_mul(u64::from(height.saturating_sub(1)))?
        .checked_add(width)?
        .checked_add(start)
}

/// Why a batch cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// An engine block id past the cache.
    #[error("engine block {block} is past the cache's {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block.
        block: u32,
        /// The cache's blocks.
        num_blocks: u32,
    },
    /// A host slot past the host buffer.
    #[error("host slot {slot} is past the buffer's {slots} slots")]
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// The buffer's slots.
        slots: u32,
    },
    /// An engine block listed twice.
    #[error("engine block {0} is listed twice in one batch")]
    DuplicateBlock(u32),
    /// A host slot listed twice.
    #[error("host slot {0} is listed twice in one batch")]
    DuplicateSlot(u32),
    /// The host buffer's slots do not fit in a 64-bit offset.
    #[error("{slots} host slots of {block_bytes} bytes do not fit in a 64-bit offset")]
    HostTooLarge {
        /// The buffer's slots.
        slots: u32,
        /// Bytes per slot.
        block_bytes: u64,
    },
}

/// The copies of one batch, grouped by layer in layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    layers: Vec<Vec<Copy2d>>,
    bytes: u64,
}

impl Plan {
    /// Each layer's copies (an empty batch has every layer empty).
    pub fn layers(&self) -> &[Vec<Copy2d>] {
        &self.layers
    }

    /// Every copy, layer after layer.
    pub fn copies(&self) -> impl Iterator<Item = &Copy2d> {
        self.layers.iter().flatten()
    }

    /// Bytes moved by the whole batch.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Plans the copies for `pairs` between `layout`'s cache and a host buffer of `host_slots`
/// slots of `layout.block_bytes()` each. The pairs may come in any order; every engine block
/// and every host slot may appear once.
pub fn plan(
    layout: &DeviceLayout,
    pairs: &[BlockPair],
    host_slots: u32,
) -> Result<Plan, PlanError> {
    let num_blocks = layout.num_blocks();
    let block_bytes = layout.block_bytes();
    if u64::from(host_slots).checked_mul(block_bytes).is_none() {
        return Err(PlanError::HostTooLarge {
            slots: host_slots,
            block_bytes,
        });
    }
    let mut sorted = pairs.to_vec();
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        if let [a, b] = w
            && a.device_block == b.device_block
        {
            return Err(PlanError::DuplicateBlock(a.device_block));
        }
    }
    let mut slots: Vec<u32> = sorted.iter().map(|p| p.host_slot).collect();
    slots.sort_unstable();
    for w in slots.windows(2) {
        if let [a, b] = w
            && a == b
        {
            return Err(PlanError::DuplicateSlot(*a));
        }
    }
    for p in &sorted {
        if p.device_block >= num_blocks {
            return Err(PlanError::BlockOutOfRange {
                block: p.device_block,
                num_blocks,
            });
        }
        if p.host_slot >= host_slots {
            return Err(PlanError::SlotOutOfRange {
                slot: p.host_slot,
                slots: host_slots,
            });
        }
    }
    let runs = runs(&sorted);
    let mut bytes = 0;
    let layers = layout
        .layers()
        .iter()
        .enumerate()
        .map(|(i, region)| {
            let offset = layout.layer_offset(i);
            let mut copies = Vec::with_capacity(runs.len() * region.planes as usize);
            for plane in 0..region.planes {
                for &(first, height) in &runs {
                    let c = Copy2d {
                        layer: i as u32,
                        device: region.address(plane, first.device_block),
                        device_pitch: region.plane_block_bytes,
                        host: u64::from(first.host_slot) * block_bytes
                            + offset
                            + u64::from(plane) * region.plane_block_bytes,
                        host_pitch: block_bytes,
                        width: region.plane_block_bytes,
                        height,
                    };
                    bytes += c.bytes();
                    copies.push(c);
                }
            }
            copies
        })
        .collect();
    Ok(Plan { layers, bytes })
}

/// Maximal runs of pairs (sorted by engine block) whose blocks and slots both go up by one.
fn runs(sorted: &[BlockPair]) -> Vec<(BlockPair, u32)> {
    let mut out: Vec<(BlockPair, u32)> = Vec::new();
    for &p in sorted {
        match out.last_mut() {
            Some((first, height))
                if first.device_block + *height == p.device_block
                    && first.host_slot.checked_add(*height) == Some(p.host_slot) =>
            {
                *height += 1;
            }
            _ => out.push((p, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayerRegion;

    fn pairs(v: &[(u32, u32)]) -> Vec<BlockPair> {
        v.iter()
            .map(|&(device_block, host_slot)| BlockPair {
                device_block,
                host_slot,
            })
            .collect()
    }

    #[test]
    fn consecutive_blocks_to_consecutive_slots_are_one_copy_per_layer_and_plane() {
        let layout = DeviceLayout::contiguous(0, 4, 2, 32, 100).expect("valid");
        let p = plan(&layout, &pairs(&[(10, 0), (11, 1), (12, 2), (13, 3)]), 8).expect("plan");
        assert_eq!(p.copies().count(), 4 * 2);
        assert_eq!(p.bytes(), 4 * 4 * 2 * 32);
        let first = p.layers()[1][1];
        assert_eq!(first.layer, 1);
        assert_eq!(first.height, 4);
        // Layer 1 starts after layer 0's two planes of 100 blocks; its plane 1 one plane later.
        assert_eq!(first.device, 2 * 100 * 32 + 100 * 32 + 10 * 32);
        assert_eq!(first.device_pitch, 32);
        // In a host block: layer 0's two planes, then layer 1's plane 0, then its plane 1.
        assert_eq!(first.host, 2 * 32 + 32);
        assert_eq!(first.host_pitch, 4 * 2 * 32);
    }

    #[test]
    fn a_break_in_either_sequence_starts_a_new_run() {
        let layout = DeviceLayout::new(vec![LayerRegion {
            base: 0,
            planes: 1,
            plane_stride: 0,
            plane_block_bytes: 8,
            num_blocks: 50,
        }])
        .expect("valid");
        // Given out of order: 3→1, 1→0 | 5→2 (block gap) | 6→4 (slot gap) | 7→5.
        let p = plan(
            &layout,
            &pairs(&[(5, 2), (1, 0), (6, 4), (7, 5), (2, 1)]),
            6,
        )
        .expect("plan");
        let heights: Vec<u32> = p.copies().map(|c| c.height).collect();
        assert_eq!(heights, vec![2, 1, 2]);
    }

    #[test]
    fn bad_batches_are_refused() {
        let layout = DeviceLayout::contiguous(0, 1, 1, 8, 4).expect("valid");
        assert_eq!(
            plan(&layout, &pairs(&[(4, 0)]), 4),
            Err(PlanError::BlockOutOfRange {
                block: 4,
                num_blocks: 4
            })
        );
        assert_eq!(
            plan(&layout, &pairs(&[(0, 4)]), 4),
            Err(PlanError::SlotOutOfRange { slot: 4, slots: 4 })
        );
        assert_eq!(
            plan(&layout, &pairs(&[(1, 0), (1, 1)]), 4),
            Err(PlanError::DuplicateBlock(1))
        );
        assert_eq!(
            plan(&layout, &pairs(&[(1, 0), (2, 0)]), 4),
            Err(PlanError::DuplicateSlot(0))
        );
        assert_eq!(plan(&layout, &[], 4).map(|p| p.bytes()), Ok(0));
        let huge = DeviceLayout::contiguous(0, 1, 1, u64::MAX / 4, 1).expect("valid");
        assert!(matches!(
            plan(&huge, &pairs(&[(0, 0)]), 8),
            Err(PlanError::HostTooLarge { slots: 8, .. })
        ));
    }

    #[test]
    fn an_extent_past_the_address_space_has_no_end() {
        let c = Copy2d {
            layer: 0,
            device: 0,
            device_pitch: 8,
            host: 0,
            host_pitch: 1 << 63,
            width: 8,
            height: 3,
        };
        assert_eq!(c.host_end(), None);
        assert_eq!(c.device_end(), Some(24));
    }
}
