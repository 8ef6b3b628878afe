//! [`check_satisfiable`]: could this request ever be met by the site as registered?
//!
//! The session manager asks this when a session is created, so that a request no GPU of the
//! site can meet is refused at once with a message naming the requirement to relax, instead of
//! waiting in the queue for ever. What is in use now and whether a node is online do not matter
//! here; unhealthy GPUs (and GPUs whose mode holds no session) do not count.

use ongrid_core::gpu::GpuRequestError;
use ongrid_core::{ComputeCapability, GpuRequest, MemorySize, Sharing};

use crate::site::{GpuSlot, SiteState};

/// Why a request can never be met by the site, naming the requirement that fails and what the
/// site has. The single requirements are checked first, then their combination, then the count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsatisfiable {
    #[error(transparent)]
    InvalidRequest(#[from] GpuRequestError),
    #[error("the site has no healthy GPU (an admin must register a GPU node or repair its GPUs)")]
    NoGpus,
    #[error("no GPU has compute capability {wanted} or more (the highest is {highest})")]
    Capability {
        wanted: ComputeCapability,
        highest: ComputeCapability,
    },
    #[error("no GPU has {wanted} of memory or more (the most is {most})")]
    Memory {
        wanted: MemorySize,
        most: MemorySize,
    },
    #[error("no GPU is in shared mode (ask for --share exclusive or any)")]
    NoSharedGpu,
    #[error("no GPU is in exclusive mode (ask for --share shared or any)")]
    NoExclusiveGpu,
    #[error("no GPU has {} together (each is met by some GPU; relax one of them)", requirements(.request))]
    NoGpuMeetsAll { request: GpuRequest },
    #[error("no node has {wanted} GPUs that meet the request (the most on one node is {most})")]
    Count { wanted: u32, most: u32 },
}

/// Whether the request could ever be met by the site as registered (ignoring what is in use now
/// and whether a node is online; unhealthy GPUs do not count).
pub fn check_satisfiable(site: &SiteState, request: &GpuRequest) -> Result<(), Unsatisfiable> {
    request.validate()?;
    let gpus = || {
        site.nodes
            .iter()
            .flat_map(|node| node.gpus.iter())
            .filter(|slot| counts(slot))
    };
    let highest = gpus().map(|slot| slot.capability).max();
    let most_memory = gpus().map(|slot| slot.memory).max();
    let (Some(highest), Some(most_memory)) = (highest, most_memory) else {
        return Err(Unsatisfiable::NoGpus);
    };
    if let Some(wanted) = request.min_capability {
        if highest < wanted {
            return Err(Unsatisfiable::Capability { wanted, highest });
        }
    }
    if let Some(wanted) = request.min_memory {
        if most_memory < wanted {
            return Err(Unsatisfiable::Memory {
                wanted,
                most: most_memory,
            });
        }
    }
    if !gpus().any(|slot| request.sharing.accepts(slot.mode)) {
        return Err(match request.sharing {
            Sharing::Shared => Unsatisfiable::NoSharedGpu,
            // `any` accepts every mode, so only `exclusive` can get here.
            Sharing::Exclusive | Sharing::Any => Unsatisfiable::NoExclusiveGpu,
            // MIG requests are checked by `check_mig_satisfiable`; none fits a whole GPU.
            Sharing::Mig(_) => Unsatisfiable::NoGpuMeetsAll { request: *request },
        });
    }
    let fits = |slot: &GpuSlot| request.fits(slot.capability, slot.memory, slot.mode);
    let most = site
        .nodes
        .iter()
        .map(|node| {
            let fitting = node.gpus.iter().filter(|slot| counts(slot) && fits(slot));
            u32::try_from(fitting.count()).unwrap_or(u32::MAX)
        })
        .max()
        .unwrap_or(0);
    if most == 0 {
        return Err(Unsatisfiable::NoGpuMeetsAll { request: *request });
    }
    if most < request.count {
        return Err(Unsatisfiable::Count {
            wanted: request.count,
            most,
        });
    }
    Ok(())
}

/// Whether a GPU could ever hold a session.
fn counts(slot: &GpuSlot) -> bool {
    slot.healthy && slot.mode.capacity() > 0
}

/// The per-GPU requirements in words: "compute capability 9.0 or more, 80 GB of memory or
/// more and shared mode".
fn requirements(request: &GpuRequest) -> String {
    let mut parts = Vec::new();
    if let Some(capability) = request.min_capability {
        parts.push(format!("compute capability {capability} or more"));
    }
    if let Some(memory) = request.min_memory {
        parts.push(format!("{memory} of memory or more"));
    }
    match request.sharing {
        Sharing::Exclusive => parts.push("exclusive mode".to_owned()),
        Sharing::Shared => parts.push("shared mode".to_owned()),
        Sharing::Any => {}
        Sharing::Mig(profile) => parts.push(format!("a MIG {profile} device")),
    }
    match parts.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => "any GPU".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::Sharing::{Any, Exclusive, Shared};

    use super::*;
    use crate::testing::*;

    fn site() -> SiteState {
        let mut offline = node("n3", vec![h100(5)]);
        offline.online = false;
        let mut broken = gpu(6, "9.5", "120G", "exclusive");
        broken.healthy = false;
        let mut busy = a100(3);
        busy.used = 1;
        SiteState {
            nodes: vec![
                node("n1", vec![t4(1), gpu(2, "7.5", "16G", "shared:4"), broken]),
                node("n2", vec![busy, a100(4)]),
                offline,
            ],
            ..SiteState::default()
        }
    }

    fn message(request: GpuRequest) -> String {
        match check_satisfiable(&site(), &request) {
            Ok(()) => "ok".to_owned(),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn what_the_site_has_is_satisfiable_busy_or_offline() {
        assert_eq!(message(request(2, Some("8.0"), None, Exclusive)), "ok");
        assert_eq!(message(request(1, Some("9.0"), Some("80G"), Any)), "ok");
        assert_eq!(message(request(1, None, None, Shared)), "ok");
    }

    #[test]
    fn an_invalid_request() {
        assert_eq!(
            message(request(0, None, None, Any)),
            "a session needs at least 1 GPU"
        );
    }

    #[test]
    fn a_site_without_healthy_gpus() {
        let mut broken = t4(1);
        broken.healthy = false;
        let site = SiteState {
            nodes: vec![node("n1", vec![broken])],
            ..SiteState::default()
        };
        assert_eq!(
            check_satisfiable(&site, &request(1, None, None, Any)),
            Err(Unsatisfiable::NoGpus)
        );
    }

    #[test]
    fn capability() {
        assert_eq!(
            message(request(1, Some("9.5"), None, Any)),
            "no GPU has compute capability 9.5 or more (the highest is 9.0)"
        );
    }

    #[test]
    fn memory() {
        assert_eq!(
            message(request(1, None, Some("100GiB"), Any)),
            "no GPU has 100.0 GiB of memory or more (the most is 80 GB)"
        );
    }

    #[test]
    fn sharing() {
        let exclusive_only = SiteState {
            nodes: vec![node("n1", vec![a100(1)])],
            ..SiteState::default()
        };
        assert_eq!(
            check_satisfiable(&exclusive_only, &request(1, None, None, Shared))
                .unwrap_err()
                .to_string(),
            "no GPU is in shared mode (ask for --share exclusive or any)"
        );
        let shared_only = SiteState {
            nodes: vec![node("n1", vec![gpu(1, "8.0", "40G", "shared:2")])],
            ..SiteState::default()
        };
        assert_eq!(
            check_satisfiable(&shared_only, &request(1, None, None, Exclusive))
                .unwrap_err()
                .to_string(),
            "no GPU is in exclusive mode (ask for --share shared or any)"
        );
    }

    #[test]
    fn single_requirements_are_named_before_the_count() {
        assert_eq!(
            message(request(5, Some("9.5"), None, Any)),
            "no GPU has compute capability 9.5 or more (the highest is 9.0)"
        );
    }

    #[test]
    fn requirements_met_only_by_different_gpus() {
        assert_eq!(
            message(request(1, Some("8.0"), None, Shared)),
            "no GPU has compute capability 8.0 or more and shared mode together \
             (each is met by some GPU; relax one of them)"
        );
        assert_eq!(
            message(request(1, Some("9.0"), Some("40G"), Shared)),
            "no GPU has compute capability 9.0 or more, 40 GB of memory or more and shared \
             mode together (each is met by some GPU; relax one of them)"
        );
    }

    #[test]
    fn count() {
        assert_eq!(
            message(request(3, Some("8.0"), None, Exclusive)),
            "no node has 3 GPUs that meet the request (the most on one node is 2)"
        );
        // The unhealthy GPU on n1 does not count.
        assert_eq!(
            message(request(3, None, None, Any)),
            "no node has 3 GPUs that meet the request (the most on one node is 2)"
        );
    }
}
