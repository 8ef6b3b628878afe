//! MIG devices as places: [`plan_mig`] puts sessions that ask for a MIG device
//! ([`ongrid_core::Sharing::Mig`]) on free MIG devices, and [`check_mig_satisfiable`] says
//! whether the site has any device that could ever meet such a request.
//!
//! MIG devices are apart from whole GPUs: a GPU in MIG mode has no whole-GPU place
//! ([`ongrid_core::GpuMode::capacity`] is 0 and no [`ongrid_core::Sharing`] but `Mig` accepts it),
//! and a MIG request fits no whole GPU, so [`crate::plan`] never gives one to the other. The
//! session manager calls `plan_mig` after `plan`, with the same [`SiteState`], then
//! [`crate::plan_mig_jobs`] for batch jobs on MIG devices and the jobs a waiting session halts.
//!
//! # Rules
//!
//! - **Where.** A device of an online, undrained node whose parent GPU is healthy, undrained and
//!   in MIG mode, that nobody uses, whose profile covers the request's (as many compute slices
//!   and as much memory or more, media extensions when asked) and that meets its capability and
//!   memory minimums. One session per device.
//! - **Who first.** Owner groups' sessions on the free devices of GPUs their group owns, then
//!   every session in `(priority, queued_at, id)` order, as for whole GPUs.
//! - **Owners and reservations.** A MIG device is bound by its parent GPU's owner and
//!   reservations ([`crate::Policy`]), with the rules of whole GPUs: others' sessions are not
//!   placed on devices of an owned GPU unless [`crate::Policy::sessions_on_owned_gpus`] (and
//!   then after devices nobody else owns), a reserved GPU's devices take only the group's
//!   sessions in the window and others' only when their maximum lifetime ends by its start, and
//!   a session naming a reservation goes only to its GPUs' devices while it is open.
//! - **Which device: least sufficient first** (fewest compute slices, then least memory, then
//!   without media extensions), so a 1g request never takes a 3g device while a 1g one is free;
//!   then the session's preferred node, then node name and UUID. A pinned session goes only to
//!   its node.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, MemorySize, MigProfile, MigUuid, NodeName,
    SessionId,
};
use serde::{Deserialize, Serialize};

use crate::policy::{Policy, Tag, Who};
use crate::site::{NodeState, PendingSession, SiteState};

/// One MIG device as the node's agent reported it, and whether a session holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigSlot {
    pub node: NodeName,
    pub uuid: MigUuid,
    pub parent: GpuUuid,
    pub profile: MigProfile,
    /// The parent GPU's compute capability.
    pub capability: ComputeCapability,
    pub memory: MemorySize,
    /// A session (or job) holds it.
    pub used: bool,
    /// The job holding it, when a job does (`used` is then true): a session may wait for it
    /// to halt, or halt it (`mig_jobs.rs`).
    #[serde(default)]
    pub job: Option<ongrid_core::job::JobId>,
}

/// Start `session` on `node` with the MIG device `device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigPlacement {
    pub session: SessionId,
    pub node: NodeName,
    pub device: MigUuid,
    pub parent: GpuUuid,
}

pub(crate) fn usable(site: &SiteState, slot: &MigSlot) -> bool {
    let Some(node) = site.nodes.iter().find(|n| n.name == slot.node) else {
        return false;
    };
    node.online && !node.drained && parent_in_mig_mode(node, &slot.parent, true)
}

fn parent_in_mig_mode(node: &NodeState, parent: &GpuUuid, undrained: bool) -> bool {
    node.gpus.iter().any(|gpu| {
        &gpu.uuid == parent
            && gpu.healthy
            && (!undrained || !gpu.drained)
            && matches!(gpu.mode, GpuMode::Mig { .. })
    })
}

/// Whether `request` asks for a MIG device and is well formed: what the MIG plans consider.
pub(crate) fn valid_mig_request(request: &GpuRequest) -> bool {
    request.sharing.mig().is_some() && request.validate().is_ok()
}

pub(crate) fn meets(slot: &MigSlot, request: &GpuRequest, wanted: MigProfile) -> bool {
    slot.profile.covers(wanted)
        && request
            .min_capability
            .is_none_or(|min| slot.capability >= min)
        && request.min_memory.is_none_or(|min| slot.memory >= min)
}

/// Places the pending sessions that ask for a MIG device on free devices at `now` (see the
/// module's rules). `slots` are all MIG devices of the site. Deterministic: the result does not
/// depend on the order of `site`'s or `slots`' vectors.
pub fn plan_mig(site: &SiteState, slots: &[MigSlot], now: DateTime<Utc>) -> Vec<MigPlacement> {
    let policy = &site.policy;
    let mut queue: Vec<&PendingSession> = site
        .pending
        .iter()
        .filter(|s| valid_mig_request(&s.request))
        .collect();
    queue.sort_by_key(|s| (s.priority, s.queued_at, s.id));
    let tags: Vec<Tag> = slots.iter().map(|s| policy.tag(&s.parent, now)).collect();
    let mut taken: HashSet<&MigUuid> = HashSet::new();
    let mut placed: HashSet<SessionId> = HashSet::new();
    let mut placements = Vec::new();
    // Owner groups first, on the devices of GPUs their group owns; then everyone anywhere the
    // policy lets them go.
    for owners_pass in [true, false] {
        for session in &queue {
            if placed.contains(&session.id) {
                continue;
            }
            let who = Who::session(policy, &session.id);
            let wanted = session.request.sharing.mig().expect("filtered above");
            let best = slots
                .iter()
                .zip(&tags)
                .filter(|(slot, _)| !slot.used && !taken.contains(&slot.uuid))
                .filter(|(_, tag)| !owners_pass || Policy::owned_by(tag, &who))
                .filter(|(slot, _)| {
                    session
                        .pinned_node
                        .as_ref()
                        .is_none_or(|pin| pin == &slot.node)
                })
                .filter(|(slot, tag)| {
                    meets(slot, &session.request, wanted)
                        && usable(site, slot)
                        && policy.allows(tag, &who, now)
                })
                .min_by_key(|(slot, tag)| {
                    (
                        !Policy::owned_by(tag, &who) && tag.owner.is_some(),
                        // MigProfile orders by slices, then memory, then media: the least sufficient first.
                        slot.profile,
                        session.preferred_node.as_ref() != Some(&slot.node),
                        &slot.node,
                        &slot.uuid,
                    )
                });
            if let Some((slot, _)) = best {
                taken.insert(&slot.uuid);
                placed.insert(session.id);
                placements.push(MigPlacement {
                    session: session.id,
                    node: slot.node.clone(),
                    device: slot.uuid.clone(),
                    parent: slot.parent.clone(),
                });
            }
        }
    }
    placements
}

/// Why no MIG device of the site could ever meet a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no MIG device on the site is {wanted} or larger{extra} (the site has: {have}); ask for a smaller profile, or an admin partitions a GPU with devctl admin gpu mode GPU mig:LAYOUT")]
pub struct NoMigDevice {
    pub wanted: MigProfile,
    /// The requirements beyond the profile, in words (`, with compute capability 9.0 or more`).
    pub extra: String,
    /// The profiles the site's usable devices have, or `none`.
    pub have: String,
}

/// Whether some MIG device of the site (of a healthy GPU in MIG mode, on any node, used or not)
/// could ever meet a MIG request. `Ok` for requests that do not ask for MIG.
pub fn check_mig_satisfiable(
    site: &SiteState,
    slots: &[MigSlot],
    request: &GpuRequest,
) -> Result<(), NoMigDevice> {
    let Some(wanted) = request.sharing.mig() else {
        return Ok(());
    };
    let counted: Vec<&MigSlot> = slots
        .iter()
        .filter(|slot| {
            site.nodes
                .iter()
                .any(|n| n.name == slot.node && parent_in_mig_mode(n, &slot.parent, false))
        })
        .collect();
    if counted.iter().any(|slot| meets(slot, request, wanted)) {
        return Ok(());
    }
    let mut have: Vec<MigProfile> = counted.iter().map(|s| s.profile).collect();
    have.sort();
    have.dedup();
    let mut extra = String::new();
    if let Some(c) = request.min_capability {
        extra.push_str(&format!(" with compute capability {c} or more"));
    }
    if let Some(m) = request.min_memory {
        extra.push_str(&format!(
            "{} {m} of memory or more",
            if extra.is_empty() { " with" } else { " and" }
        ));
    }
    Err(NoMigDevice {
        wanted,
        extra,
        have: if have.is_empty() {
            "none".to_owned()
        } else {
            have.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        },
    })
}
