//! The Docker labels the agent puts on what it creates (containers, volumes, networks): how it
//! finds its own things again after a restart. Below `runtime/` and `network/`, which both
//! label; `runtime` re-exports them.

/// `true` on every container and volume ongrid manages.
pub const LABEL_MANAGED: &str = "ongrid.managed";
/// The session's id.
pub const LABEL_SESSION: &str = "ongrid.session";
/// The session's name.
pub const LABEL_SESSION_NAME: &str = "ongrid.session.name";
/// The login name of the user inside the container.
pub const LABEL_USER: &str = "ongrid.user";
/// The owner's DN.
pub const LABEL_OWNER: &str = "ongrid.owner";
/// The node whose agent manages the container. Several agents may share one Docker daemon
/// (the quickstart, the tests), so each one only sees and touches its own containers.
pub const LABEL_NODE: &str = "ongrid.node";
/// Set on the agent's short-lived helper containers (value: what it does); they have no session.
pub const LABEL_HELPER: &str = "ongrid.helper";
/// The GPUs the dev container was created with, as `CUDA_VISIBLE_DEVICES` lists them. A held
/// container released onto other GPUs is recreated (see `reconcile.rs`).
pub const LABEL_GPUS: &str = "ongrid.gpus";

/// The batch job's id, on its container and its network.
pub const LABEL_JOB: &str = "ongrid.job";
