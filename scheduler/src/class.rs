//! GPU classes and the order of preference among them.
//!
//! A class is what a request's per-GPU requirements look at: compute capability, memory and the
//! admin's mode. Sites have few classes (a T4, an A100 40GB, an H100 ...) and many GPUs, so the
//! planner indexes free capacity per class. The order defined here is "least capable first"; the
//! planner always takes the least class that fits, keeping big GPUs for those who need them.

use std::cmp::Ordering;

use ongrid_core::{ComputeCapability, GpuMode, GpuRequest, MemorySize};

/// The properties of a GPU that decide which requests it fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GpuClass {
    pub capability: ComputeCapability,
    pub memory: MemorySize,
    pub mode: GpuMode,
    /// Its owner and reservations (site policy, `policy.rs`), numbered by the index; 0 is
    /// neither. Ranked last, so that among equal GPUs a free one comes first.
    pub tag: usize,
}

impl GpuClass {
    pub fn fits(&self, request: &GpuRequest) -> bool {
        request.fits(self.capability, self.memory, self.mode)
    }
}

/// Least capable first: by compute capability, then memory, then mode. Among equal capability
/// and memory a share of a GPU counts as less than a whole GPU, and a share of a GPU split more
/// ways as less than one split fewer ways, so a request that accepts `any` takes a share and
/// leaves whole GPUs to those who asked for exclusive ones. Among equal GPUs, one bound by no
/// owner or reservation comes first, keeping owned and reserved GPUs for their groups.
impl Ord for GpuClass {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.capability, self.memory, mode_rank(self.mode))
            .cmp(&(other.capability, other.memory, mode_rank(other.mode)))
            // MIG layouts rank alike; their text keeps the order total.
            .then_with(|| {
                let layout = |mode: GpuMode| mode.mig_layout().map(|l| l.to_string());
                layout(self.mode).cmp(&layout(other.mode))
            })
            .then(self.tag.cmp(&other.tag))
    }
}

impl PartialOrd for GpuClass {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// `shared:N` (larger N first) before `exclusive`. One-to-one, so the order is total.
fn mode_rank(mode: GpuMode) -> (u8, u32) {
    match mode {
        GpuMode::Shared { max_sessions } => (0, u32::MAX - max_sessions),
        GpuMode::Exclusive => (1, 0),
        // Never fits a request (capacity 0); ranked last for a total order.
        GpuMode::Mig { .. } => (2, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(capability: &str, memory: &str, mode: &str) -> GpuClass {
        GpuClass {
            capability: capability.parse().unwrap(),
            memory: memory.parse().unwrap(),
            mode: mode.parse().unwrap(),
            tag: 0,
        }
    }

    #[test]
    fn capability_then_memory_then_mode() {
        let mut classes = [
            class("9.0", "80G", "exclusive"),
            class("8.0", "80G", "exclusive"),
            class("8.0", "40G", "exclusive"),
            class("8.0", "40G", "shared:2"),
            class("8.0", "40G", "shared:4"),
            class("7.5", "80G", "exclusive"),
            class("10.0", "16G", "exclusive"),
        ];
        classes.sort();
        let order: Vec<String> = classes
            .iter()
            .map(|c| format!("{} {} {}", c.capability, c.memory, c.mode))
            .collect();
        assert_eq!(
            order,
            [
                "7.5 80 GB exclusive",
                "8.0 40 GB shared:4",
                "8.0 40 GB shared:2",
                "8.0 40 GB exclusive",
                "8.0 80 GB exclusive",
                "9.0 80 GB exclusive",
                "10.0 16 GB exclusive",
            ]
        );
    }
}
