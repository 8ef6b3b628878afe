//! ongrid-scheduler: pure, deterministic placement of pending sessions and batch jobs onto GPU
//! slots, and the halting of jobs (max duration, interactive priority).
//!
//! The session manager calls [`plan`] at every scheduling tick with a snapshot of the whole site
//! ([`SiteState`]: nodes, pending sessions, queued and running jobs) and applies the returned
//! [`Action`]s; it calls [`check_satisfiable`] when a
//! session is created, to refuse at once a request the site can never meet. No I/O, no clock:
//! the same input always gives the same plan, whatever the order of the input's vectors.
//!
//! # Rules of a plan
//!
//! - **Where.** All GPUs of a session are distinct GPUs of one online node. Offline or drained nodes
//!   and unhealthy or drained GPUs get nothing new (what runs there keeps running). A GPU in mode `m` with `used` sessions has
//!   `m.capacity() - used` free places (none when an admin shrank the capacity below `used`);
//!   an `exclusive` GPU holds one session, a `shared:N` GPU up to N. Every GPU given to a
//!   session meets its request ([`ongrid_core::GpuRequest::fits`]: capability, memory, and the
//!   modes its sharing accepts).
//! - **Who first.** Pending sessions are served in `(priority, queued_at, id)` order, each
//!   taking the best place left: [`Priority`] is the owner's fair-share standing (their group's
//!   usage against its share, then their own usage; lower first), computed by the session
//!   manager; equal priorities (all zero on a site without fair share) are first come, first
//!   served. One that cannot be placed now does not block later ones (backfill), but since
//!   capacity only shrinks during a plan, of two equal requests the one first in that order
//!   always wins. Queued jobs are ordered the same way among themselves.
//! - **Which GPUs: least capable first**, keeping big GPUs for those who need them. GPUs are
//!   ordered by class (compute capability, then memory, then mode: a share of a GPU before a
//!   whole one, see `class.rs`), then node name, then UUID. A one-GPU session takes the least
//!   GPU that fits. A session of N GPUs takes, on each node, that node's N least fitting free
//!   GPUs, and goes to the node whose set is least: the sets' classes are compared from the
//!   most capable down, then node names.
//! - **Pack shared GPUs.** Among GPUs of the same class, the one with the fewest free places
//!   comes first, so a shared GPU that already has sessions fills up before an empty one is
//!   started. For a one-GPU session this applies across the site (before node names); for a
//!   session of N GPUs, within the chosen node.
//! - **Back where it was.** A session's `preferred_node` (e.g. the node it ran on before a hold)
//!   wins whenever that node can take it at all; the GPUs on it are still chosen least first.
//! - **Pinned.** A session with a `pinned_node` (a released session whose stopped container is
//!   there) goes only to that node and waits while that node has no room (or is offline, or
//!   unknown). It gets its `previous_gpus` back when they are all free and fit (so its container
//!   restarts as it is), else the node's GPUs least first. Dropping a pin is the session
//!   manager's decision.
//!
//! - **Owned GPUs and reservations** (`policy.rs`, [`Policy`] in [`SiteState::policy`]): an
//!   owner group's sessions, then jobs, take its free GPUs before any other request; other
//!   groups' jobs run there as backfill, halted for owner work; other groups' sessions stay off
//!   unless [`Policy::sessions_on_owned_gpus`]. A reserved GPU takes only its group's work in the
//!   window, other groups' jobs there are halted when it opens, and other groups' work starts
//!   there before it only when its max duration ends by the start.
//!
//! # Batch jobs
//!
//! - **One plan, one capacity.** A GPU's `used` counts sessions and jobs alike; queued jobs
//!   are placed by the same rules as sessions (least capable first, packing, pins), after every
//!   session, so neither ever over-allocates a GPU. Jobs never halt anything.
//! - **Time.** A running job at or past `started_at + max_duration` gets an
//!   [`Action::HaltJob`] (once: not while it is halting). A queued job is not started before its
//!   `not_before` and gets an [`Action::CancelJob`] once `now` reaches its `not_after`.
//! - **Buckets.** A job with bucket `NAME:MAX` starts only while fewer than `MAX` of its owner's
//!   jobs of bucket `NAME` hold GPUs (running or halting, and those started by this plan).
//! - **Interactive priority.** A session that finds no free place halts the fewest jobs that
//!   are past their min duration on one node such that it can start there at once when they
//!   are HALTED, preferring to wait for jobs that are halting already ([`Action::PlaceAfterHalt`]
//!   after the [`Action::HaltJob`]s, whose reason names the session's need, not its user; the
//!   rules and their ties are in `batch.rs`). A job within its min duration is never halted for
//!   a session. A GPU being halted is not free: the session stays PENDING with the placement as
//!   its [`HaltWait`], later plans keep that placement's free GPUs for it while its jobs run and
//!   give it exactly that placement once they are gone and the GPUs free.

mod batch;
mod class;
mod index;
mod mig;
mod mig_jobs;
mod plan;
mod policy;
mod satisfiable;
mod site;
#[cfg(test)]
mod testing;

pub use mig::{check_mig_satisfiable, plan_mig, MigPlacement, MigSlot, NoMigDevice};
pub use mig_jobs::{plan_mig_jobs, MigJobAction};
pub use plan::plan;
pub use policy::{Access, Policy, Reservation};
pub use satisfiable::{check_satisfiable, Unsatisfiable};
pub use site::{
    Action, GpuSlot, HaltWait, NodeState, PendingSession, Priority, QueuedJob, RunningJob,
    SiteState,
};
