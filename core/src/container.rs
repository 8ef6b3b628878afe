//! What a container (a dev session's or a batch job's) is given on its node: the user it runs
//! as and its resource limits. Shared by the agent's desired state (`api.rs`) and the jobs
//! (`job.rs`), below both.

use serde::{Deserialize, Serialize};

use crate::names::UserName;
use crate::quantity::MemorySize;

/// The unprivileged user a dev container runs as; UID and GID are equal and stable per DN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerUser {
    pub name: UserName,
    pub uid: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerLimits {
    /// CPU in thousandths of a core (`1500` = 1.5 cores; Docker `NanoCpus` = this × 10^6).
    pub millicpus: u32,
    pub memory: MemorySize,
    pub pids: u32,
}
