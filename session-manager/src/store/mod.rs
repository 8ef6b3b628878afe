//! Persistence of everything the manager knows: users, sessions with their full transition
//! history, nodes and GPUs, users' SSH keys, the institutes allowlist and the audit log of SSH
//! connections.
//!
//! The rest of the manager talks to the [`Store`] trait only; [`sqlite::SqliteStore`] is the
//! embedded implementation (one file, WAL) and `postgres::PostgresStore` (feature `postgres`)
//! the one for a database server, chosen by the config's `database` ([`Database`]). Both are one
//! implementation: the statements are written once, in `sql/`, which each backend module
//! compiles against its own database (see `sql/mod.rs`); the backend modules hold only what
//! differs (connecting, beginning a write or a snapshot, PostgreSQL's notifications and
//! active-manager lock). Migrations stay per backend. SQL lives under this module and nowhere
//! else.
//!
//! The store decides nothing: the rules are in [`crate::domain`], and this module depends on it
//! only for the records it stores and the decisions it applies. Session states change only
//! through [`Store::transition`], which replays the stored history into an
//! [`ongrid_core::Lifecycle`], applies the [`Change`] and stores the new transition and state in
//! one transaction: an invalid change is a typed error and the history is always complete. Where
//! a decision must see exactly what it is written over, the store calls the domain's rule inside
//! that transaction: [`Store::record_connection`] (so that two connections opening and closing at
//! once can never leave a session IDLE with a connection open), [`Store::hold_if_due`] (so that
//! a connection or a keep-alive that came in after the timer looked cancels the hold) and
//! [`Store::create_image`] (one current image per tag).

#[cfg(feature = "postgres")]
pub mod copy;
pub mod dashboard;
pub mod database;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod gpu_policy;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod sqlite;
#[cfg(all(test, feature = "postgres"))]
pub(crate) mod test_server;
#[cfg(test)]
mod tests;

/// The store's writes made together (`sql/together.rs`), for the tests that hold them.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Together {
    Creates,
    Submits,
    /// Changes of sessions and jobs.
    Changes,
    /// Heartbeats, activity samples and jobs' output records.
    SyncRecords,
}

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use ongrid_core::api::{AuditRecord, ConnectionEvent, UserEvent};
use ongrid_core::gpu::Drain;
use ongrid_core::{
    Dn, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid, Institute, InstituteName, InvalidTransition,
    NodeName, SessionId, SessionName, SessionState, Transition, UserName,
};

pub use dashboard::{DashboardIdentity, DashboardLogin, DashboardStore};
pub use database::{Database, OpenedStore};
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

use ongrid_core::holds::{ContainerActivity, HoldReason};
use ongrid_core::image::{Compression, ImageReference, ImageState};
use ongrid_core::store_identity::StoreIdentity;

use crate::domain::images::{ImageChange, ImageRecord};
use crate::domain::jobs::{JobChange, JobRecord, NewJob};
use crate::domain::sessions::holds::{LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::{Change, SessionRecord};
use crate::domain::users::{Removal, Removed};
use ongrid_core::job::JobId;

/// What went wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The owner already has a session of that name that has not ended.
    #[error("a session named {name} already exists ({state})")]
    NameTaken {
        name: SessionName,
        state: SessionState,
    },
    #[error(transparent)]
    InvalidTransition(#[from] InvalidTransition),
    #[error("no session with id {0}")]
    NoSuchSession(SessionId),
    #[error("no job with id {0}")]
    NoSuchJob(ongrid_core::job::JobId),
    #[error(transparent)]
    InvalidJobTransition(#[from] ongrid_core::job::InvalidJobTransition),
    /// The SSH key is registered to another owner.
    #[error("key {fingerprint} belongs to another user")]
    KeyTaken { fingerprint: String },
    /// The owner already has the most keys allowed.
    #[error("the owner already has {max} keys")]
    TooManyKeys { max: usize },
    #[error("institute {0} already exists")]
    InstituteExists(InstituteName),
    /// The owner has a current image of that tag (BUILDING, or READY when not forced).
    #[error("image {reference} already exists ({state})")]
    ImageTagTaken {
        reference: ImageReference,
        state: ImageState,
    },
    /// A freeze of the session is running.
    #[error("session {session} is being frozen to {reference}")]
    FreezeRunning {
        session: SessionName,
        reference: ImageReference,
    },
    /// The owner was removed by an admin: nothing new is stored for them.
    #[error("user {0} was removed by an admin")]
    UserRemoved(Dn),
    /// A stored value does not parse back: the database was edited by hand or is damaged.
    #[error("stored data is damaged: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migrating the database: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// A user as the manager knows them: the DN and the stable login name and UID given to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRecord {
    pub dn: Dn,
    pub user_name: UserName,
    pub uid: u32,
    /// Set while an admin has removed them ([`crate::domain::users`]).
    pub removed: Option<Removed>,
}

/// A session to create, PENDING from `at`.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub id: SessionId,
    /// `None`: the store picks the owner's first free name of `dev`, `dev-2`, `dev-3`, ...
    pub name: Option<SessionName>,
    pub owner: Dn,
    pub request: GpuRequest,
    pub image: String,
    pub at: DateTime<Utc>,
    pub reason: String,
    /// The session's own idle timeout and maximum lifetime, stored with it (`None`: the site's
    /// default).
    pub idle_timeout_secs: Option<u64>,
    pub max_duration_secs: Option<u64>,
}

/// Which sessions a listing returns. ENDED sessions are never listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionFilter {
    Owner(Dn),
    All,
    /// In any of these states (site-wide).
    States(Vec<SessionState>),
    /// Placed on this node (whatever their state, but ENDED).
    Node(NodeName),
}

/// What an agent says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRegistration {
    pub name: NodeName,
    pub gpu_backend: String,
    pub agent_version: String,
    /// The agent's stream endpoint for the SSH gateway; `None` when it has none.
    pub stream_url: Option<String>,
    /// The mode a GPU the store does not know yet starts in (else exclusive); a known GPU
    /// keeps its stored mode.
    pub start_modes: std::collections::BTreeMap<GpuUuid, GpuMode>,
}

/// Each change's outcome of [`Store::round_changes`], in the order given.
#[derive(Debug, Default)]
pub struct RoundOutcomes {
    pub sessions: Vec<StoreResult<()>>,
    pub jobs: Vec<StoreResult<()>>,
}

/// How many sessions and jobs are in each state, and the GPUs they hold
/// ([`Store::state_counts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateCounts {
    pub sessions: Vec<(String, i64)>,
    pub jobs: Vec<(String, i64)>,
    /// The whole GPUs and MIG devices that sessions and jobs in a state holding GPUs hold,
    /// each once.
    pub gpus_in_use: BTreeSet<GpuId>,
}

/// A registered node with its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    pub name: NodeName,
    pub gpu_backend: String,
    pub agent_version: String,
    /// The agent's stream endpoint for the SSH gateway (`wss://...`), as last registered.
    pub stream_url: Option<String>,
    pub last_seen: DateTime<Utc>,
    /// Ordered by PCI bus id, then UUID. Shared: the planning read hands out the GPUs it keeps
    /// without copying them ([`Store::planning_nodes`]).
    pub gpus: std::sync::Arc<[GpuRecord]>,
    /// Set while an admin has the node drained (migration 0013).
    pub drain: Option<Drain>,
}

/// The nodes of [`Store::planning_nodes`], with the inventory version read before them: the
/// nodes and GPUs are at least as new as it (what the scheduler plans with of them changes only
/// with the version; their last syncs and GPUs' utilisation aside).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanningNodes {
    pub version: i64,
    pub nodes: Vec<NodeRecord>,
}

/// What a node's desired state reads of the site besides its sessions and jobs
/// ([`Store::desired_reads`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredReads {
    /// The node's GPUs: the planning read's kept ones, or read alone when the inventory changed
    /// since.
    pub gpus: std::sync::Arc<[GpuRecord]>,
    /// Its freeze orders and the images to remove ([`ImageFilter::ForNode`]), in the order
    /// [`Store::images`] gives them.
    pub images: Vec<ImageRecord>,
}

/// What runs on a node, as its desired state reads it ([`Store::desired_reads_and_work`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeWork {
    /// Its sessions, as [`Store::sessions`] reads them for [`SessionFilter::Node`].
    pub sessions: Vec<SessionRecord>,
    /// The node's STARTING sessions whose container ran before ([`Store::resuming_on`]), read
    /// after `sessions` and only when one of those is STARTING (so it may name one that
    /// `sessions` has in another state).
    pub ran_before: Vec<SessionId>,
    /// Its jobs, as [`Store::jobs`] reads them for [`JobFilter::Node`].
    pub jobs: Vec<JobRecord>,
}

pub use crate::domain::nodes::NodeContents;

/// What [`Store::remove_node`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeRemoval {
    Removed,
    NoSuchNode,
    /// Refused: it says why and what to do.
    Refused(crate::domain::Refusal),
}

/// A GPU with the admin's policy for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRecord {
    pub node: NodeName,
    pub info: GpuInfo,
    pub mode: GpuMode,
    /// Set while an admin has the GPU drained (migration 0013).
    pub drain: Option<Drain>,
}

/// An SSH public key bound to a user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    /// `SHA256:<base64>`; unique across the site.
    pub fingerprint: String,
    pub owner: Dn,
    pub user_name: UserName,
    pub algorithm: String,
    /// OpenSSH one-line format, without the comment.
    pub public_key: String,
    pub comment: String,
    pub added_at: DateTime<Utc>,
    /// Refused from then on: the notAfter of the certificate it was (last) registered with.
    pub expires_at: DateTime<Utc>,
    /// The verified FQANs of the credential it was (last) registered with, which the gateway's
    /// login re-checks against the site's admission; `None` for keys registered before the
    /// store kept them (migration 0019).
    pub fqans: Option<Vec<String>>,
    /// The issuer (config name) of the bearer token it was (last) registered with; `None`: a
    /// certificate or proxy.
    pub token_issuer: Option<String>,
}

/// A token identity an admin linked to a user (`devctl admin user link`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenLink {
    /// The issuer's `iss` URL.
    pub issuer: String,
    pub subject: String,
    /// The user its tokens act as.
    pub dn: Dn,
    pub linked_at: DateTime<Utc>,
}

/// A key to bind to `owner`, registered at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewKey {
    pub fingerprint: String,
    pub owner: Dn,
    pub algorithm: String,
    pub public_key: String,
    pub comment: String,
    pub at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// The verified FQANs of the credential registering it.
    pub fqans: Vec<String>,
    /// The issuer (config name) of the bearer token registering it; `None`: a certificate.
    pub token_issuer: Option<String>,
}

/// What [`Store::add_key`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyAdded {
    /// The key was new.
    New(KeyRecord),
    /// The owner had it already: its expiry (and comment) were renewed.
    Renewed(KeyRecord),
}

/// Which connections the audit log returns, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditFilter {
    pub owner: Option<Dn>,
    /// Connections open at any time since then: still open, or closed at or after it.
    pub since: Option<DateTime<Utc>>,
    pub limit: u32,
}

/// What [`Store::record_connection`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionRecorded {
    /// The session after the event.
    pub session: SessionRecord,
    /// Its connections still open.
    pub open_connections: u32,
    /// The change of state the event caused.
    pub transition: Option<Transition>,
}

/// What a recorded heartbeat found ([`Store::record_sync`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// When the node was seen before this heartbeat.
    pub last_seen: DateTime<Utc>,
    /// Whether its GPUs changed in anything the scheduler reads: a GPU added, gone, healthy or
    /// not, its MIG devices or its waiting MIG change (not its utilisation, which changes every
    /// sync).
    pub gpus_changed: bool,
}

/// How much of a job's output the manager has ([`Store::record_job_logs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputKept {
    pub id: JobId,
    /// The bytes of its output kept: the agent's next offset.
    pub size: u64,
    /// Nothing follows them.
    pub complete: bool,
}

/// The manager's persistent state. Every method is one transaction.
pub trait Store: Send + Sync {
    /// The web dashboard's login links and browser logins (migration 0016).
    fn dashboard(&self) -> &dyn DashboardStore;

    /// Owned GPUs and reservations (migration 0018).
    fn gpu_policy(&self) -> &dyn gpu_policy::GpuPolicyStore;

    /// Which copy of the store this is (migration 0021, [`ongrid_core::store_identity`]).
    fn identity(&self) -> BoxFuture<'_, StoreResult<StoreIdentity>>;

    /// Makes this database a new copy of its store (after a restore from a backup): its
    /// generation one above its own, or `at_least` when that is higher. The identity after.
    fn mark_restored(&self, at_least: Option<u64>) -> BoxFuture<'_, StoreResult<StoreIdentity>>;

    /// The DN whose user the tokens of `issuer` (its `iss` URL) and `subject` act as, when an
    /// admin linked them.
    fn token_link<'a>(
        &'a self,
        issuer: &'a str,
        subject: &'a str,
    ) -> BoxFuture<'a, StoreResult<Option<Dn>>>;

    /// Links the tokens of `issuer` and `subject` to the user of `dn` (replacing a link they
    /// had); `false` when that user was removed or never used the site.
    fn link_token<'a>(&'a self, link: &'a TokenLink) -> BoxFuture<'a, StoreResult<bool>>;

    /// Removes the link of `issuer` and `subject`; the removed link, if there was one.
    fn unlink_token<'a>(
        &'a self,
        issuer: &'a str,
        subject: &'a str,
    ) -> BoxFuture<'a, StoreResult<Option<TokenLink>>>;

    /// Every link, by DN then issuer and subject.
    fn token_links(&self) -> BoxFuture<'_, StoreResult<Vec<TokenLink>>>;

    /// The user record of `dn`, created on first sight with a login name derived from the DN
    /// (made unique with `-2`, `-3`, ...) and the next UID from `first_uid` upward.
    fn user<'a>(&'a self, dn: &'a Dn, first_uid: u32) -> BoxFuture<'a, StoreResult<UserRecord>>;

    /// [`Self::user`], and the accounting group last recorded for them
    /// ([`Self::set_accounting_group`]; `None` before any), read together: what every request
    /// of a person looks up.
    fn user_and_group<'a>(
        &'a self,
        dn: &'a Dn,
        first_uid: u32,
    ) -> BoxFuture<'a, StoreResult<(UserRecord, Option<crate::domain::policy::GroupName>)>>;

    /// Creates a PENDING session. The owner's [`UserRecord`] must exist.
    fn create_session(&self, new: NewSession) -> BoxFuture<'_, StoreResult<SessionRecord>>;

    fn session(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Option<SessionRecord>>>;

    /// The owner's session of that name that has not ended, else the last one that did.
    fn session_by_name<'a>(
        &'a self,
        owner: &'a Dn,
        name: &'a SessionName,
    ) -> BoxFuture<'a, StoreResult<Option<SessionRecord>>>;

    /// Sessions that have not ended, ordered by creation.
    fn sessions(&self, filter: SessionFilter) -> BoxFuture<'_, StoreResult<Vec<SessionRecord>>>;

    /// How many sessions that have not ended, and jobs, are in each state (by the state's
    /// name; states with none are left out), and the GPUs they hold (from the copies kept for
    /// planning). For the metrics.
    fn state_counts(&self) -> BoxFuture<'_, StoreResult<StateCounts>>;

    /// The PENDING sessions in queue order, `(queued_at, id)`.
    fn pending_order(&self) -> BoxFuture<'_, StoreResult<Vec<SessionId>>>;

    /// Session `id`'s 1-based place in that order; `None` when it is not PENDING.
    fn pending_place(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Option<u32>>>;

    /// The session's full history, oldest first.
    fn transitions(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Vec<Transition>>>;

    /// Applies each change as [`Store::transition`] does, all in one write: what one sync of a
    /// node reports. The changes of other callers waiting for the write meanwhile go in it too,
    /// after those before them. Each change's outcome is given in order; a change its session's
    /// lifecycle refuses (or of a session that does not exist) is left out of the write and the
    /// others are stored. An error of the database fails the write; each caller's changes are
    /// then written alone, so that error is only the failing caller's. A caller's changes are
    /// stored even if it goes away before the answer (what it would have done after, such as
    /// waking the node's long-poll, is then left to the next sync or round).
    fn transition_all(
        &self,
        changes: Vec<(SessionId, Change)>,
    ) -> BoxFuture<'_, StoreResult<Vec<StoreResult<()>>>>;

    /// A scheduling round's decisions in one write: its placements, as
    /// [`Store::transition_all`] applies them, and its job changes, as
    /// [`Store::job_transition_all`] does. One write, so the placements wait for the store's
    /// writer once, and the agents they wake learn of the round's jobs with them. Other
    /// callers' changes waiting at the same time may share it, as with those two.
    fn round_changes(
        &self,
        sessions: Vec<(SessionId, Change)>,
        jobs: Vec<(JobId, JobChange, Option<NewJob>)>,
    ) -> BoxFuture<'_, StoreResult<RoundOutcomes>>;

    /// Applies `change` through the session's [`ongrid_core::Lifecycle`] and stores it.
    fn transition(
        &self,
        id: SessionId,
        change: Change,
    ) -> BoxFuture<'_, StoreResult<SessionRecord>>;

    /// Creates or updates a node and its GPU inventory; the node counts as seen at `at`.
    /// New GPUs get mode `exclusive`; known ones keep the admin's mode. GPUs of the node that are
    /// no longer reported are kept, marked failed.
    fn register_node<'a>(
        &'a self,
        node: NodeRegistration,
        gpus: &'a [GpuInfo],
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Records a heartbeat: last seen at `at`, GPU inventory and health as reported (a GPU's row
    /// is written only when what the agent says of it changed). `None` when the node never
    /// registered.
    fn record_sync<'a>(
        &'a self,
        node: &'a NodeName,
        gpus: &'a [GpuInfo],
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<Heartbeat>>>;

    /// Every registered node with its GPUs, ordered by name.
    fn nodes(&self) -> BoxFuture<'_, StoreResult<Vec<NodeRecord>>>;

    /// Every registered node with its GPUs as [`Self::nodes`], for planning: the nodes and GPUs
    /// are read again only when the site's inventory changed since this store last read them (a
    /// node registered, drained or removed; a GPU added, gone or moved, its health, MIG devices,
    /// mode or drain), else kept from then, so a GPU's utilisation may be as old as that read.
    /// A node's last sync is exact when it is before `seen_since`; a node seen at or after it
    /// shows `seen_since` or later: enough to tell, against a cutoff at `seen_since` or before,
    /// which nodes stopped responding, without reading every node's row. For the scheduler's
    /// rounds and a request's checks; what people see of the nodes comes from [`Self::nodes`].
    fn planning_nodes(
        &self,
        seen_since: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<PlanningNodes>>;

    /// What `node`'s desired state reads besides its sessions and jobs, for a sync that read
    /// those itself (the others read all with [`Self::desired_reads_and_work`]): its GPUs as
    /// [`Self::planning_nodes`] keeps them (a GPU's utilisation as old as that read), read alone
    /// when the site's inventory changed since, and the images [`ImageFilter::ForNode`] names
    /// for it with `images_removed_since`. `None` when the node is not registered (or was
    /// removed). One statement reads the inventory's version, looks the node up and tells
    /// whether any such image exists, so the sync needs no lookup of its own and, with no freeze
    /// or removal going on, no read of the images.
    fn desired_reads<'a>(
        &'a self,
        node: &'a NodeName,
        images_removed_since: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<DesiredReads>>>;

    /// [`Self::desired_reads`] and the node's work ([`NodeWork`]), read on one connection taken
    /// from the pool once: what a long-poll answer reads, usually in three statements (the
    /// version's, the sessions', the jobs'; more when the kept GPUs or jobs are older than the
    /// rows, when images are to be read, when a session is STARTING). Each statement is its
    /// own snapshot, as when each took a connection of its own; taken once, the connection
    /// goes back once, and sqlx's check of it on its way back (a round trip to its thread on
    /// SQLite, to the server on PostgreSQL) is made once instead of after each statement.
    fn desired_reads_and_work<'a>(
        &'a self,
        node: &'a NodeName,
        images_removed_since: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<(DesiredReads, NodeWork)>>>;

    /// The sessions PENDING or holding GPUs, ordered as [`Self::sessions`] orders them, for
    /// planning: kept by this store and brought up to date with the sessions written since its
    /// last call (by any manager on the database), so a round does not read every one of them.
    fn planning_sessions(&self) -> BoxFuture<'_, StoreResult<Vec<std::sync::Arc<SessionRecord>>>>;

    /// One registered node with its GPUs (what an agent's sync or a stream to it needs, without
    /// reading the whole site); `None` when it is not registered or was removed.
    fn node<'a>(&'a self, name: &'a NodeName) -> BoxFuture<'a, StoreResult<Option<NodeRecord>>>;

    /// Sets a GPU's mode; `None` when no such GPU is registered.
    fn set_gpu_mode<'a>(
        &'a self,
        uuid: &'a GpuUuid,
        mode: GpuMode,
    ) -> BoxFuture<'a, StoreResult<Option<GpuRecord>>>;

    /// Drains a node (`Some`) or puts it back in service (`None`); a drain already in place is
    /// kept as it is (its reason and time). `false` when no such node is registered.
    fn set_node_drain<'a>(
        &'a self,
        node: &'a NodeName,
        drain: Option<Drain>,
    ) -> BoxFuture<'a, StoreResult<bool>>;

    /// Drains a GPU (`Some`) or puts it back in service (`None`), like [`Store::set_node_drain`].
    /// `None` when no such GPU is registered.
    fn set_gpu_drain<'a>(
        &'a self,
        uuid: &'a GpuUuid,
        drain: Option<Drain>,
    ) -> BoxFuture<'a, StoreResult<Option<GpuRecord>>>;

    /// Forgets a node at `at` when [`crate::domain::nodes::removal`] allows it (offline for
    /// longer than `node_timeout`, nothing left on it), decided on what the same transaction
    /// reads, so nothing is placed there meanwhile. Its rows stay, unlisted, for the history;
    /// its agent registering again brings it back.
    fn remove_node<'a>(
        &'a self,
        node: &'a NodeName,
        at: DateTime<Utc>,
        node_timeout: std::time::Duration,
    ) -> BoxFuture<'a, StoreResult<NodeRemoval>>;

    /// Binds a key to its owner, or renews it when the owner has it already (new expiry and
    /// comment). [`StoreError::KeyTaken`] when another owner has it, [`StoreError::TooManyKeys`]
    /// when a new key would give the owner more than `max_per_owner`.
    fn add_key(&self, key: NewKey, max_per_owner: usize) -> BoxFuture<'_, StoreResult<KeyAdded>>;

    fn key<'a>(&'a self, fingerprint: &'a str) -> BoxFuture<'a, StoreResult<Option<KeyRecord>>>;

    /// The keys of `owner` (everyone's when `None`), ordered by owner then time added.
    fn keys<'a>(&'a self, owner: Option<&'a Dn>) -> BoxFuture<'a, StoreResult<Vec<KeyRecord>>>;

    /// Removes the key if it exists and, when `owner` is given, is theirs.
    fn remove_key<'a>(
        &'a self,
        fingerprint: &'a str,
        owner: Option<&'a Dn>,
    ) -> BoxFuture<'a, StoreResult<Option<KeyRecord>>>;

    /// Adds an institute; [`StoreError::InstituteExists`] if the name is taken.
    fn add_institute<'a>(
        &'a self,
        institute: &'a Institute,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    fn institute<'a>(
        &'a self,
        name: &'a InstituteName,
    ) -> BoxFuture<'a, StoreResult<Option<Institute>>>;

    /// Every institute, ordered by name.
    fn institutes(&self) -> BoxFuture<'_, StoreResult<Vec<Institute>>>;

    fn remove_institute<'a>(
        &'a self,
        name: &'a InstituteName,
    ) -> BoxFuture<'a, StoreResult<Option<Institute>>>;

    /// Stores a connection event in the audit log (an open inserts the row, a close sets its
    /// end and byte totals, a close never opened inserts the whole row; a repeated event changes
    /// nothing more), counts the session's open connections, and applies the change
    /// [`crate::domain::sessions::connections::follow_connection`] decides at `at` — all in one
    /// transaction. [`StoreError::NoSuchSession`] if the session does not exist.
    fn record_connection<'a>(
        &'a self,
        event: &'a ConnectionEvent,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<ConnectionRecorded>>;

    /// The audit log, newest first (by the time connections opened), at most `filter.limit`.
    fn audit(&self, filter: AuditFilter) -> BoxFuture<'_, StoreResult<Vec<AuditRecord>>>;

    /// Removes at most `limit` connections of the audit log that closed before `closed_before`
    /// (open ones are always kept); returns how many.
    fn prune_connections(
        &self,
        closed_before: DateTime<Utc>,
        limit: u32,
    ) -> BoxFuture<'_, StoreResult<u64>>;

    /// Records a freeze to start: a BUILDING image. When the owner has a current image of
    /// the tag, it is superseded when [`crate::domain::images::supersedes`] says so, else
    /// [`StoreError::ImageTagTaken`].
    /// [`StoreError::FreezeRunning`] when the session is being frozen already.
    fn create_image(&self, new: NewImage) -> BoxFuture<'_, StoreResult<ImageRecord>>;

    fn image(&self, id: uuid::Uuid) -> BoxFuture<'_, StoreResult<Option<ImageRecord>>>;

    /// Images that are not DELETED, oldest first.
    fn images(&self, filter: ImageFilter) -> BoxFuture<'_, StoreResult<Vec<ImageRecord>>>;

    /// Applies `change` at `at` to image `id` if it is BUILDING on `node`: progress, or READY
    /// with the artifact, or FAILED with the reason. `None` when no such image is BUILDING on
    /// that node (already finished, deleted meanwhile, or not that node's).
    fn record_freeze<'a>(
        &'a self,
        node: &'a NodeName,
        id: uuid::Uuid,
        change: &'a ImageChange,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<ImageRecord>>>;

    /// Shares image `id` since `shared_at`, or makes it private again (`None`). `None` when it
    /// does not exist or is DELETED.
    fn set_image_shared(
        &self,
        id: uuid::Uuid,
        shared_at: Option<DateTime<Utc>>,
    ) -> BoxFuture<'_, StoreResult<Option<ImageRecord>>>;

    /// Marks the image DELETED (a BUILDING one is given up: its agent cancels the freeze).
    /// `None` when it does not exist or is DELETED already.
    fn delete_image(
        &self,
        id: uuid::Uuid,
        at: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<Option<ImageDeleted>>>;

    /// The lifecycle facts (see [`crate::domain::sessions::holds`]) of the sessions in `scope`,
    /// with the last report time of each of their open connections.
    fn lifecycle_facts(&self, scope: FactsScope)
        -> BoxFuture<'_, StoreResult<Vec<LifecycleFacts>>>;

    /// The STARTING sessions on `node` that ran before (their lifecycle has a first start):
    /// released from a hold, their container stopped, to be started again. One read for a
    /// node's desired state.
    fn resuming_on<'a>(&'a self, node: &'a NodeName) -> BoxFuture<'a, StoreResult<Vec<SessionId>>>;

    /// Sets the end of the session's explicit keep-alive.
    fn set_keep_until(&self, id: SessionId, until: DateTime<Utc>)
        -> BoxFuture<'_, StoreResult<()>>;

    /// Records an agent's activity samples of sessions placed on `node` (others are ignored),
    /// as seen at `at`, writing those the hold policy must see now and the others' activity with
    /// a later one ([`crate::domain::sessions::facts::reading_due`]); how many were recorded.
    fn record_activity<'a>(
        &'a self,
        node: &'a NodeName,
        samples: &'a [ContainerActivity],
        at: DateTime<Utc>,
        lifecycle: &'a LifecycleConfig,
    ) -> BoxFuture<'a, StoreResult<usize>>;

    /// Holds the session if [`crate::domain::sessions::holds::due_hold`] says a hold is due at
    /// `now` on its lifecycle facts as they are inside the write transaction, so that nothing
    /// (a connection, a keep-alive, activity) can slip in between the decision and the change.
    /// The held session and why; `None` when no hold is due or the session is gone.
    fn hold_if_due<'a>(
        &'a self,
        id: SessionId,
        config: &'a LifecycleConfig,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<(SessionRecord, HoldReason)>>>;

    /// Creates a QUEUED job with its first transition.
    fn create_job(&self, new: NewJob) -> BoxFuture<'_, StoreResult<JobRecord>>;

    fn job(&self, id: JobId) -> BoxFuture<'_, StoreResult<Option<JobRecord>>>;

    /// Jobs in queue order, `(queued_at, id)`.
    fn jobs(&self, filter: JobFilter) -> BoxFuture<'_, StoreResult<Vec<JobRecord>>>;

    /// The jobs QUEUED or holding GPUs ([`JobFilter::Active`]) in queue order, kept in memory
    /// and shared: what a round plans with and a job's view ranks it among. Their output's size
    /// and a grid engine's fields are as of the job's last change of state or chain.
    fn planning_jobs(&self) -> BoxFuture<'_, StoreResult<Vec<std::sync::Arc<JobRecord>>>>;

    /// Applies `change` through the job's [`ongrid_core::job::JobLifecycle`] and stores it, with
    /// `next` (the next job of its restart chain, see
    /// [`crate::domain::jobs::next_in_chain`]) created and linked in the same transaction: a
    /// [`Store::job_transition_all`] of one, and the job read back as it leaves it.
    fn job_transition(
        &self,
        id: JobId,
        change: JobChange,
        next: Option<NewJob>,
    ) -> BoxFuture<'_, StoreResult<JobRecord>>;

    /// Applies each change as [`Store::job_transition`] does, all in one write: what one sync of
    /// a node reports, what one request or check of the scheduler changes. Each change's
    /// outcome is given in order; a change its job's lifecycle refuses
    /// ([`StoreError::InvalidJobTransition`]) or of a job that does not exist
    /// ([`StoreError::NoSuchJob`]) is left out of the write with its next job, and the others
    /// are stored. A job changed again, or a next job changed after it was created, is changed
    /// as the batch's earlier changes left it. Other callers' changes (of jobs or of sessions)
    /// waiting at the same time may share the write, applied as if one caller wrote after the
    /// other; each caller gets its own outcomes, and its changes are stored even if it goes
    /// away before the answer. An error of the database fails the caller's changes (a shared
    /// write is then retried one caller at a time). Nothing is read back: a caller that needs a
    /// job as it is now reads it.
    fn job_transition_all(
        &self,
        changes: Vec<(JobId, JobChange, Option<NewJob>)>,
    ) -> BoxFuture<'_, StoreResult<Vec<StoreResult<()>>>>;

    /// Records how much of each job's output the manager has (the agent's next offset) and
    /// whether it is all in; a job recorded twice is left as the later says. A caller's list is
    /// stored whole or not at all. Other callers' records waiting at the same time may share the
    /// write; they are stored even if the caller goes away before the answer.
    fn record_job_logs(&self, logs: Vec<OutputKept>) -> BoxFuture<'_, StoreResult<()>>;

    /// [`Store::record_job_logs`] of one job.
    fn record_job_log(
        &self,
        id: JobId,
        size: u64,
        complete: bool,
    ) -> BoxFuture<'_, StoreResult<()>> {
        self.record_job_logs(vec![OutputKept { id, size, complete }])
    }

    /// Removes the record of job `id` (its history, its grid row, the links to it from its
    /// chain's other jobs, and its chain's reservation once no job of the chain is left) when
    /// [`crate::domain::jobs::removal`] allows it at `now`, decided on what the same transaction
    /// reads. Its output file is the caller's to delete.
    fn remove_job(
        &self,
        id: JobId,
        output_grace: std::time::Duration,
        now: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<JobRemoval>>;

    /// Removes, as [`Store::remove_job`] does, at most `limit` jobs that ended before
    /// `ended_before` (see [`crate::domain::jobs::prune_before`]) and that no grid engine
    /// still follows; returns their ids, so that their output files can go too.
    fn prune_jobs(
        &self,
        ended_before: DateTime<Utc>,
        limit: u32,
    ) -> BoxFuture<'_, StoreResult<Vec<JobId>>>;

    /// Stores the engine's id of a job handed to a grid target (table `grid_jobs`), as soon as
    /// the engine answered and before anyone is told the job was submitted.
    fn set_engine_id<'a>(
        &'a self,
        id: JobId,
        engine_id: &'a crate::domain::grid_jobs::EngineJobId,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Records that the manager begins to hand a grid job to its engine (a re-queued job of a
    /// chain, submitted by the mirroring loop); `None` forgets it (to be handed over again).
    fn mark_submit_started(
        &self,
        id: JobId,
        at: Option<DateTime<Utc>>,
    ) -> BoxFuture<'_, StoreResult<()>>;

    /// Records what a grid job's engine said at a poll: its words, why it keeps the job waiting,
    /// and whether it is done with it (once done, it stays done).
    fn record_engine_poll<'a>(
        &'a self,
        id: JobId,
        poll: crate::domain::engine_job::EnginePoll<'a>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// The grid jobs the mirroring loop follows: those whose engine is not done with them, or
    /// whose output is not all in, in queue order.
    fn grid_jobs_to_mirror(&self) -> BoxFuture<'_, StoreResult<Vec<JobRecord>>>;

    /// The user record of `dn`, if the manager has seen them (never created here).
    fn existing_user<'a>(&'a self, dn: &'a Dn) -> BoxFuture<'a, StoreResult<Option<UserRecord>>>;

    /// Every user, removed ones included, ordered by login name.
    fn users(&self) -> BoxFuture<'_, StoreResult<Vec<UserRecord>>>;

    /// Records `group` as `dn`'s accounting group (fair share), with no usage when new; writes
    /// nothing when it is already so.
    fn set_accounting_group<'a>(
        &'a self,
        dn: &'a Dn,
        group: &'a crate::domain::policy::GroupName,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Every user's fair-share account, by DN.
    fn usage_accounts(
        &self,
    ) -> BoxFuture<'_, StoreResult<Vec<crate::domain::policy::fairshare::Account>>>;

    /// Stores the accounts' usage and time (creating those not yet stored).
    fn save_usage<'a>(
        &'a self,
        accounts: &'a [crate::domain::policy::fairshare::Account],
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// What admins did to `dn` (everyone when `None`), oldest first per user.
    fn user_events<'a>(
        &'a self,
        dn: Option<&'a Dn>,
    ) -> BoxFuture<'a, StoreResult<Vec<(Dn, UserEvent)>>>;

    /// Marks `dn` removed by `by` at `at`, deletes their SSH keys and writes the event (with
    /// `removal`'s summary), in one transaction; from then on nothing new is stored for them
    /// ([`StoreError::UserRemoved`]). The keys deleted; `None` when no such user is there to
    /// remove (unknown, or removed already).
    fn remove_user<'a>(
        &'a self,
        dn: &'a Dn,
        by: &'a Dn,
        at: DateTime<Utc>,
        removal: &'a Removal,
    ) -> BoxFuture<'a, StoreResult<Option<Vec<KeyRecord>>>>;

    /// Clears the removal of `dn` and writes the event; `None` when they are not removed.
    fn restore_user<'a>(
        &'a self,
        dn: &'a Dn,
        by: &'a Dn,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<UserRecord>>>;
}

/// Which jobs [`Store::jobs`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobFilter {
    Owner(Dn),
    All,
    /// QUEUED, RUNNING, MUSTHALT or HALTING: what the scheduler plans. Copied from
    /// [`Store::planning_jobs`]: a job's output size and grid engine fields as of its last
    /// change of state or chain.
    Active,
    /// Placed on this node and holding GPUs, or ended there with output not all in: what its
    /// agent is told about.
    Node(NodeName),
}

/// What [`Store::remove_job`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobRemoval {
    /// The job as it was.
    Removed(Box<JobRecord>),
    NoSuchJob,
    /// Refused: it says why and what to do.
    Refused(crate::domain::Refusal),
}

/// Whose lifecycle facts [`Store::lifecycle_facts`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FactsScope {
    Session(SessionId),
    /// Every session in one of these states.
    States(Vec<SessionState>),
}

/// A freeze to record, BUILDING from `at`.
#[derive(Debug, Clone)]
pub struct NewImage {
    pub id: uuid::Uuid,
    pub owner: Dn,
    pub reference: ImageReference,
    pub session_id: SessionId,
    pub session_name: SessionName,
    pub node: NodeName,
    pub base_image: String,
    pub compression: Compression,
    /// Move the tag from a READY image of the owner.
    pub force: bool,
    pub at: DateTime<Utc>,
    pub reason: String,
}

/// Which images [`Store::images`] returns (never DELETED ones, but for `ForNode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageFilter {
    Owner(Dn),
    All,
    /// The owner's current image of a tag (at most one).
    Tag {
        owner: Dn,
        reference: ImageReference,
    },
    /// Images with this digest, the owner's or everyone's; superseded ones included.
    Digest {
        owner: Option<Dn>,
        digest: String,
    },
    /// The current image of a tag of the user with this login (at most one).
    LoginTag {
        user_name: UserName,
        reference: ImageReference,
    },
    /// Every shared image, superseded ones included.
    Shared,
    /// What a node's desired state names, in one read (it is built for every sync and
    /// long-poll answer): the images BUILDING on `node` (its agent's freeze orders) and those
    /// DELETED at or after `removed_since` (whose Docker images must leave the nodes).
    ForNode {
        node: NodeName,
        removed_since: DateTime<Utc>,
    },
    /// BUILDING on any node: what the freeze watch checks.
    AllBuilding,
}

/// What [`Store::delete_image`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDeleted {
    pub image: ImageRecord,
    /// No image that is not DELETED has the digest any more: its SIF file may go.
    pub digest_unreferenced: bool,
}
