//! ongrid-core: the domain types and pure logic every other crate shares.
//!
//! Values are parsed at the edge into these types ([`SessionName::parse`], [`GpuUuid::parse`],
//! [`HumanDuration::parse`], ...), so the rest of the code never handles raw strings. No I/O and
//! no async runtime here.

pub mod api;
pub mod container;
pub mod gpu;
pub mod gpu_id;
pub mod holds;
pub mod image;
pub mod job;
pub mod mig;
pub mod names;
pub mod network;
pub mod quantity;
pub mod reservation;
pub mod session;
pub mod store_identity;
pub mod stream;

pub use gpu::{
    GpuHealth, GpuId, GpuIdError, GpuInfo, GpuMode, GpuRequest, GpuUuid, MigUuid, Sharing,
};
pub use job::{JobId, JobReason, JobSpec, JobSpecFile, JobState};
pub use mig::{MigChange, MigDevice, MigError, MigLayout, MigModel, MigProfile};
pub use names::{Dn, NameError, NodeName, SessionId, SessionName, UserName};
pub use network::{normalize_ip, Allowlist, Cidr, Institute, InstituteName};
pub use quantity::{ComputeCapability, HumanDuration, MemorySize};
pub use session::{InvalidTransition, Lifecycle, SessionState, Transition};
