//! Where an engine's paged KV cache lives on the device, and where a kvgate block lives in host
//! memory.
//!
//! A kvgate block is one engine block across every attention layer, as the vLLM connector and
//! the daemon's segment lay it out: layer after layer, and within a layer plane after plane
//! (the K and V halves of a `[2, num_blocks, …]` tensor are two planes; a blocks-first tensor
//! or an MLA latent cache is one). On the device, block `b` of plane `p` of a layer starts at
//! `base + p · plane_stride + b · plane_block_bytes`. In host memory, block slot `s` starts at
//! `s · block_bytes`, and its part for (layer `l`, plane `p`) at
//! `s · block_bytes + layer_offset(l) + p · plane_block_bytes`.

/// One attention layer's KV tensor on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRegion {
    /// The device address of block 0 of plane 0.
    pub base: u64,
    /// Planes per layer (2 for separate K and V halves, 1 for blocks-first or MLA caches).
    pub planes: u32,
    /// Bytes from one plane's block 0 to the next plane's block 0.
    pub plane_stride: u64,
    /// Bytes of one block in one plane (block size × heads × head size × dtype size).
    pub plane_block_bytes: u64,
    /// Blocks in the engine's cache.
    pub num_blocks: u32,
}

impl LayerRegion {
    /// Bytes of one block of this layer (all its planes).
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.planes) * self.plane_block_bytes
    }

    /// The device address of block `block` in plane `plane` (no bounds check).
    pub(crate) fn address(&self, plane: u32, block: u32) -> u64 {
        self.base + u64::from(plane) * self.plane_stride + u64::from(block) * self.plane_block_bytes
    }
}

/// Why a device layout is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No layers.
    #[error("the layout has no layers")]
    Empty,
    /// A layer with no planes, no blocks or empty blocks.
    #[error("layer {layer}: planes, blocks and bytes per block must all be positive")]
    Degenerate {
        /// The layer's index.
        layer: usize,
    },
    /// A layer's planes overlap each other.
    #[error(
        "layer {layer}: a plane of {num_blocks} blocks of {plane_block_bytes} bytes does not fit \
         in a plane stride of {plane_stride} bytes"
    )]
    PlanesOverlap {
        /// The layer's index.
        layer: usize,
        /// Its blocks.
        num_blocks: u32,
        /// Its bytes per block per plane.
        plane_block_bytes: u64,
        /// Its plane stride.
        plane_stride: u64,
    },
    /// A layer's last byte is past the end of the address space.
    #[error("layer {layer}: its region ends past the end of the 64-bit address space")]
    Overflow {
        /// The layer's index.
        layer: usize,
    },
    /// Layers disagree on the number of blocks.
    #[error(
        "layer {layer} has {found} blocks, layer 0 has {expected}: every layer indexes the same blocks"
    )]
    BlockCount {
        /// The layer's index.
        layer: usize,
        /// Layer 0's blocks.
        expected: u32,
        /// This layer's.
        found: u32,
    },
}

/// An engine's KV cache on one device: its layers in the order kvgate blocks list them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLayout {
    layers: Vec<LayerRegion>,
    /// Offset of each layer's part in a host block.
    offsets: Vec<u64>,
    block_bytes: u64,
}

impl DeviceLayout {
    /// Checks the layers and computes the host block layout.
    pub fn new(layers: Vec<LayerRegion>) -> Result<Self, LayoutError> {
        let first = layers.first().ok_or(LayoutError::Empty)?;
        let expected = first.num_blocks;
        let mut offsets = Vec::with_capacity(layers.len());
        let mut block_bytes = 0u64;
        for (i, l) in layers.iter().enumerate() {
            if l.planes == 0 || l.num_blocks == 0 || l.plane_block_bytes == 0 {
                return Err(LayoutError::Degenerate { layer: i });
            }
            if l.num_blocks != expected {
                return Err(LayoutError::BlockCount {
                    layer: i,
                    expected,
                    found: l.num_blocks,
                });
            }
            let plane_len = u64::from(l.num_blocks)
                .checked_mul(l.plane_block_bytes)
                .ok_or(LayoutError::Overflow { layer: i })?;
            if l.planes > 1 && l.plane_stride < plane_len {
                return Err(LayoutError::PlanesOverlap {
                    layer: i,
                    num_blocks: l.num_blocks,
                    plane_block_bytes: l.plane_block_bytes,
                    plane_stride: l.plane_stride,
                });
            }
            u64::from(l.planes - 1)
                .checked_mul(l.plane_stride)
                .and_then(|planes| planes.checked_add(plane_len))
                .and_then(|len| len.checked_add(l.base))
                .ok_or(LayoutError::Overflow { layer: i })?;
            offsets.push(block_bytes);
            block_bytes = u64::from(l.planes)
                .checked_mul(l.plane_block_bytes)
                .and_then(|b| block_bytes.checked_add(b))
                .ok_or(LayoutError::Overflow { layer: i })?;
        }
        Ok(Self {
            layers,
            offsets,
            block_bytes,
        })
    }

    /// The layers.
    pub fn layers(&self) -> &[LayerRegion] {
        &self.layers
    }

    /// Bytes of one kvgate block (every layer, every plane): a host slot's size.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Blocks in the engine's cache.
    pub fn num_blocks(&self) -> u32 {
        self.layers.first().map_or(0, |l| l.num_blocks)
    }

    /// The offset of layer `layer`'s part in a host block.
    pub(crate) fn layer_offset(&self, layer: usize) -> u64 {
        self.offsets.get(layer).copied().unwrap_or(self.block_bytes)
    }

    /// A contiguous layout: every layer's tensor right after the previous one from `base`,
    /// each `planes × num_blocks × plane_block_bytes` (how the benchmark lays out its buffer).
    pub fn contiguous(
        base: u64,
        layers: u32,
        planes: u32,
        plane_block_bytes: u64,
        num_blocks: u32,
    ) -> Result<Self, LayoutError> {
        let plane_stride = u64::from(num_blocks).saturating_mul(plane_block_bytes);
        let layer_len = plane_stride.saturating_mul(u64::from(planes));
        let regions = (0..u64::from(layers))
            .map(|l| LayerRegion {
                base: base.saturating_add(l.saturating_mul(layer_len)),
                planes,
                plane_stride,
                plane_block_bytes,
                num_blocks,
            })
            .collect();
        Self::new(regions)
    }

    /// Bytes from the first layer's base to the end of the last byte any layer covers.
    pub fn device_span(&self) -> u64 {
        let start = self.layers.iter().map(|l| l.base).min().unwrap_or(0);
        let end = self
            .layers
            .iter()
            .map(|l| l.address(l.planes - 1, l.num_blocks))
            .max()
            .unwrap_or(0);
        end - start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(base: u64, planes: u32, stride: u64, bytes: u64, blocks: u32) -> LayerRegion {
        LayerRegion {
            base,
            planes,
            plane_stride: stride,
            plane_block_bytes: bytes,
            num_blocks: blocks,
        }
    }

    #[test]
    fn host_blocks_list_layers_then_planes() {
        let l = DeviceLayout::new(vec![layer(0, 2, 400, 100, 4), layer(4096, 1, 0, 64, 4)])
            .expect("valid");
        assert_eq!(l.block_bytes(), 264);
        assert_eq!(l.layer_offset(0), 0);
        assert_eq!(l.layer_offset(1), 200);
        assert_eq!(l.num_blocks(), 4);
    }

    #[test]
    fn bad_layouts_are_refused_with_the_layer_named() {
        assert_eq!(DeviceLayout::new(vec![]), Err(LayoutError::Empty));
        assert_eq!(
            DeviceLayout::new(vec![layer(0, 0, 0, 8, 4)]),
            Err(LayoutError::Degenerate { layer: 0 })
        );
        assert!(matches!(
            DeviceLayout::new(vec![layer(0, 1, 0, 8, 4), layer(0, 2, 16, 8, 4)]),
            Err(LayoutError::PlanesOverlap { layer: 1, .. })
        ));
        assert_eq!(
            DeviceLayout::new(vec![layer(0, 1, 0, 8, 4), layer(64, 1, 0, 8, 5)]),
            Err(LayoutError::BlockCount {
                layer: 1,
                expected: 4,
                found: 5
            })
        );
        assert_eq!(
            DeviceLayout::new(vec![layer(u64::MAX - 10, 1, 0, 8, 4)]),
            Err(LayoutError::Overflow { layer: 0 })
        );
    }

    #[test]
    fn a_contiguous_layout_spans_every_layer() {
        let l = DeviceLayout::contiguous(4096, 3, 2, 16, 10).expect("valid");
        assert_eq!(l.device_span(), 3 * 2 * 16 * 10);
        assert_eq!(l.block_bytes(), 3 * 2 * 16);
    }
}
