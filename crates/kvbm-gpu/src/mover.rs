//! Issuing a plan: copies in stream order, an event after each layer (a caller waits on the
//! event of the layer it needs: `CudaEvent::synchronize`, or nothing for [`HostMover`]).
//!
//! [`Mover`] is the device layer: [`crate::cuda::CudaMover`] on a CUDA stream, or
//! [`HostMover`], whose "device" is host memory (the CPU backend's case, the benchmark's
//! no-GPU rows, and the tests, which check every plan byte for byte against it).

use crate::plan::{Copy2d, Direction, Plan};

/// Something that executes 2-D copies in order and marks points in that order.
pub trait Mover {
    /// A point in the mover's order; completes when every copy enqueued before it has.
    type Event;
    /// Why a copy or an event failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Enqueues one copy after everything enqueued so far.
    fn copy(&mut self, direction: Direction, copy: &Copy2d) -> Result<(), Self::Error>;

    /// Marks the current end of the queue.
    fn record(&mut self) -> Result<Self::Event, Self::Error>;
}

/// Enqueues every copy of `plan`, layer by layer, and returns one event per layer: the
/// engine may start layer `l`'s attention once event `l` completes (layer-wise onboarding),
/// and the batch is done when the last one has.
pub fn enqueue<M: Mover>(
    mover: &mut M,
    direction: Direction,
    plan: &Plan,
) -> Result<Vec<M::Event>, M::Error> {
    let _span = tracing::debug_span!("enqueue", ?direction, bytes = plan.bytes()).entered();
    plan.layers()
        .iter()
        .map(|copies| {
            for c in copies {
                mover.copy(direction, c)?;
            }
            mover.record()
        })
        .collect()
}

/// A copy outside the memory a [`HostMover`] holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("copy of layer {layer} touches {side} bytes [{start}, {end}) outside the {len} it holds")]
pub struct OutOfBounds {
    /// The copy's layer.
    pub layer: u32,
    /// `device` or `host`.
    pub side: &'static str,
    /// The first byte touched (an address or an offset).
    pub start: u64,
    /// One past the last.
    pub end: u64,
    /// The memory's size.
    pub len: usize,
}

/// A mover whose device is host memory: `device` holds addresses `[base, base + len)`.
/// Copies run at once (memcpy per row), so an event is complete as soon as it is recorded.
#[derive(Debug)]
pub struct HostMover<'a> {
    base: u64,
    device: &'a mut [u8],
    host: &'a mut [u8],
    copies: u64,
}

impl<'a> HostMover<'a> {
    /// A mover between `device` (taken to start at address `base`) and `host`.
    pub fn new(base: u64, device: &'a mut [u8], host: &'a mut [u8]) -> Self {
        Self {
            base,
            device,
            host,
            copies: 0,
        }
    }

    /// Copies executed so far.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    fn range(
        c: &Copy2d,
        side: &'static str,
        start: u64,
        end: u64,
        len: usize,
    ) -> Result<(usize, usize), OutOfBounds> {
        let err = || OutOfBounds {
            layer: c.layer,
            side,
            start,
            end,
            len,
        };
        let s = usize::try_from(start).map_err(|_| err())?;
        let e = usize::try_from(end).map_err(|_| err())?;
        if e > len || s > e {
            return Err(err());
        }
        Ok((s, e))
    }
}

impl Mover for HostMover<'_> {
    type Event = u64;
    type Error = OutOfBounds;

    fn copy(&mut self, direction: Direction, c: &Copy2d) -> Result<(), OutOfBounds> {
        let err = |side, start, end: Option<u64>, len| OutOfBounds {
            layer: c.layer,
            side,
            start,
            end: end.unwrap_or(u64::MAX),
            len,
        };
        // Check the whole extent once, without overflow; every row below is then in bounds.
        let dev_start = c
            .device
            .checked_sub(self.base)
            .ok_or_else(|| err("device", c.device, c.device_end(), self.device.len()))?;
        let relative = Copy2d {
            device: dev_start,
            ..*c
        };
        let dev_end = relative
            .device_end()
            .ok_or_else(|| err("device", c.device, None, self.device.len()))?;
        let host_end = c
            .host_end()
            .ok_or_else(|| err("host", c.host, None, self.host.len()))?;
        Self::range(c, "device", dev_start, dev_end, self.device.len())?;
        Self::range(c, "host", c.host, host_end, self.host.len())?;
        let width = c.width as usize;
        for row in 0..u64::from(c.height) {
            let d = (dev_start + row * c.device_pitch) as usize;
            let h = (c.host + row * c.host_pitch) as usize;
            let (Some(dev), Some(host)) = (
                self.device.get_mut(d..d + width),
                self.host.get_mut(h..h + width),
            ) else {
                // Unreachable after the extent checks: refused rather than skipped.
                return Err(err(
                    "device or host",
                    c.device,
                    c.device_end(),
                    self.device.len(),
                ));
            };
            match direction {
                Direction::ToHost => host.copy_from_slice(dev),
                Direction::ToDevice => dev.copy_from_slice(host),
            }
        }
        self.copies += 1;
        Ok(())
    }

    fn record(&mut self) -> Result<u64, OutOfBounds> {
        Ok(self.copies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DeviceLayout, LayerRegion};
    use crate::plan::{BlockPair, plan};
    use proptest::prelude::*;

    /// A layout of 1–3 layers with 1–2 planes each, laid out in one device buffer with gaps,
    /// and the buffer's size.
    fn layout_strategy() -> impl Strategy<Value = (DeviceLayout, usize)> {
        (
            1u32..12,
            prop::collection::vec((1u32..3, 1u64..9, 0u64..5, 0u64..7), 1..4),
        )
            .prop_map(|(num_blocks, layers)| {
                let mut base = 64u64;
                let mut regions = Vec::new();
                for (planes, bytes, stride_pad, gap) in layers {
                    let plane_stride = u64::from(num_blocks) * bytes + stride_pad;
                    base += gap;
                    regions.push(LayerRegion {
                        base,
                        planes,
                        plane_stride,
                        plane_block_bytes: bytes,
                        num_blocks,
                    });
                    base += u64::from(planes) * plane_stride;
                }
                let layout = DeviceLayout::new(regions).expect("generated layouts are valid");
                (layout, (base - 64) as usize)
            })
    }

    /// An injective batch: a subset of the blocks, each to a distinct slot of `slots`.
    fn batch(num_blocks: u32, slots: u32) -> impl Strategy<Value = Vec<BlockPair>> {
        (
            Just((0..num_blocks).collect::<Vec<_>>()).prop_shuffle(),
            Just((0..slots).collect::<Vec<_>>()).prop_shuffle(),
            0..=num_blocks.min(slots) as usize,
            any::<bool>(),
        )
            .prop_map(|(blocks, slots, n, sorted)| {
                let mut pairs: Vec<BlockPair> = blocks
                    .into_iter()
                    .zip(slots)
                    .take(n)
                    .map(|(device_block, host_slot)| BlockPair {
                        device_block,
                        host_slot,
                    })
                    .collect();
                if sorted {
                    // Runs as an engine's allocator gives them: consecutive to consecutive.
                    let mut b: Vec<u32> = pairs.iter().map(|p| p.device_block).collect();
                    b.sort_unstable();
                    for (i, p) in pairs.iter_mut().enumerate() {
                        p.device_block = b[i];
                        p.host_slot = i as u32;
                    }
                }
                pairs
            })
    }

    /// The naive model: every (block, layer, plane) copied on its own, from the definitions.
    fn naive(
        layout: &DeviceLayout,
        pairs: &[BlockPair],
        device: &mut [u8],
        host: &mut [u8],
        to_host: bool,
    ) {
        let bb = layout.block_bytes() as usize;
        let mut offset = 0usize;
        for l in layout.layers() {
            for p in 0..l.planes {
                let w = l.plane_block_bytes as usize;
                for pair in pairs {
                    let d = (l.base - 64) as usize
                        + p as usize * l.plane_stride as usize
                        + pair.device_block as usize * w;
                    let h = pair.host_slot as usize * bb + offset + p as usize * w;
                    if to_host {
                        host[h..h + w].copy_from_slice(&device[d..d + w]);
                    } else {
                        device[d..d + w].copy_from_slice(&host[h..h + w]);
                    }
                }
            }
            offset += l.block_bytes() as usize;
        }
    }

    proptest! {
        #[test]
        fn a_plan_moves_exactly_what_per_block_copies_move(
            (layout, span, slots, pairs) in (layout_strategy(), 1u32..16).prop_flat_map(
                |((layout, span), slots)| {
                    let pairs = batch(layout.num_blocks(), slots);
                    (Just(layout), Just(span), Just(slots), pairs)
                }
            ),
            seed in any::<u64>(),
            to_host in any::<bool>(),
        ) {
            let host_len = slots as usize * layout.block_bytes() as usize;
            let fill = |len: usize, salt: u64| -> Vec<u8> {
                (0..len).map(|i| (i as u64).wrapping_mul(2654435761).wrapping_add(seed ^ salt) as u8).collect()
            };
            let (mut dev_a, mut host_a) = (fill(span, 1), fill(host_len, 2));
            let (mut dev_b, mut host_b) = (dev_a.clone(), host_a.clone());
            let direction = if to_host { Direction::ToHost } else { Direction::ToDevice };

            let p = plan(&layout, &pairs, slots).expect("valid batch");
            let mut mover = HostMover::new(64, &mut dev_a, &mut host_a);
            let events = enqueue(&mut mover, direction, &p).expect("in bounds");
            prop_assert_eq!(events.len(), layout.layers().len());
            let planes: u64 = layout.layers().iter().map(|l| u64::from(l.planes)).sum();
            prop_assert!(mover.copies() <= planes * pairs.len() as u64);
            prop_assert_eq!(p.bytes(), pairs.len() as u64 * layout.block_bytes());

            naive(&layout, &pairs, &mut dev_b, &mut host_b, to_host);
            prop_assert_eq!(dev_a, dev_b);
            prop_assert_eq!(host_a, host_b);
        }

        #[test]
        fn a_run_of_consecutive_blocks_costs_one_copy_per_layer_and_plane(
            (layout, span) in layout_strategy(),
            start in 0u32..12,
            len in 1u32..12,
        ) {
            let n = layout.num_blocks();
            let start = start % n;
            let len = len.min(n - start);
            let pairs: Vec<BlockPair> = (0..len)
                .map(|i| BlockPair { device_block: start + i, host_slot: i })
                .collect();
            let p = plan(&layout, &pairs, len).expect("valid");
            let mut dev = vec![0u8; span];
            let mut host = vec![0u8; len as usize * layout.block_bytes() as usize];
            let mut mover = HostMover::new(64, &mut dev, &mut host);
            let events = enqueue(&mut mover, Direction::ToHost, &p).expect("in bounds");
            let planes: u64 = layout.layers().iter().map(|l| u64::from(l.planes)).sum();
            prop_assert_eq!(mover.copies(), planes);
            // One event per layer, each after that layer's copies.
            let mut done = 0;
            for (event, l) in events.iter().zip(layout.layers()) {
                done += u64::from(l.planes);
                prop_assert_eq!(*event, done);
            }
        }
    }

    #[test]
    fn a_copy_outside_the_memory_is_refused_not_done() {
        let mut dev = vec![0u8; 16];
        let mut host = vec![7u8; 16];
        let mut m = HostMover::new(100, &mut dev, &mut host);
        let c = Copy2d {
            layer: 0,
            device: 100,
            device_pitch: 8,
            host: 0,
            host_pitch: 8,
            width: 8,
            height: 3,
        };
        let err = m
            .copy(Direction::ToDevice, &c)
            .expect_err("24 bytes into 16");
        assert_eq!(err.side, "device");
        assert_eq!(m.copies(), 0);
        let below = Copy2d {
            device: 99,
            height: 1,
            ..c
        };
        assert!(m.copy(Direction::ToHost, &below).is_err());
        // A pitch that wraps the extent around the address space.
        let wrapping = Copy2d {
            host_pitch: 1 << 63,
            height: 3,
            ..c
        };
        assert_eq!(
            m.copy(Direction::ToHost, &wrapping).map_err(|e| e.side),
            Err("host")
        );
        assert_eq!(dev, vec![0u8; 16]);
        assert_eq!(host, vec![7u8; 16]);
    }
}
