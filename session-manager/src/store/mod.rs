//! Persistence of everything the manager knows: users, sessions with their full transition
//! history, nodes and GPUs.
//!
//! The rest of the manager talks to the [`Store`] trait only; [`sqlite::SqliteStore`] is the
//! embedded implementation (one file, WAL), and a PostgreSQL one can follow for multi-replica
//! sites. SQL lives under this module and nowhere else.
//!
//! Session states change only through [`Store::transition`], which replays the stored history
//! into an [`ongrid_core::Lifecycle`], applies the change and stores the new transition and state
//! in one transaction: an invalid change is a typed error and the history is always complete.

pub mod sqlite;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use ongrid_core::{
    Dn, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid, InvalidTransition, NodeName, SessionId,
    SessionName, SessionState, Transition, UserName,
};

pub use sqlite::SqliteStore;

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
}

/// A session as stored, with its owner's login and UID (for containers and views).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: SessionId,
    pub name: SessionName,
    pub owner: Dn,
    pub user_name: UserName,
    pub uid: u32,
    pub state: SessionState,
    /// Reason of the last transition.
    pub reason: String,
    pub request: GpuRequest,
    pub image: String,
    /// Where it is placed; kept after it ends, to show where it ran.
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuId>,
    pub created_at: DateTime<Utc>,
    /// When it (last) joined the queue; the queue is ordered by `(queued_at, id)`.
    pub queued_at: DateTime<Utc>,
    pub preferred_node: Option<NodeName>,
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
}

/// How a transition changes the session's placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Node and GPUs stay as they are.
    Keep,
    /// Placed on `node`, given `gpus`.
    Place { node: NodeName, gpus: Vec<GpuId> },
    /// Back in the queue: no node, no GPUs.
    Clear,
}

/// One change of a session's state.
#[derive(Debug, Clone)]
pub struct Change {
    pub to: SessionState,
    pub at: DateTime<Utc>,
    pub reason: String,
    pub placement: Placement,
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
}

/// A registered node with its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    pub name: NodeName,
    pub gpu_backend: String,
    pub agent_version: String,
    pub last_seen: DateTime<Utc>,
    /// Ordered by PCI bus id, then UUID.
    pub gpus: Vec<GpuRecord>,
}

/// A GPU with the admin's policy for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRecord {
    pub node: NodeName,
    pub info: GpuInfo,
    pub mode: GpuMode,
}

/// The manager's persistent state. Every method is one transaction.
pub trait Store: Send + Sync {
    /// The user record of `dn`, created on first sight with a login name derived from the DN
    /// (made unique with `-2`, `-3`, ...) and the next UID from `first_uid` upward.
    fn user<'a>(&'a self, dn: &'a Dn, first_uid: u32) -> BoxFuture<'a, StoreResult<UserRecord>>;

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

    /// The PENDING sessions in queue order, `(queued_at, id)`.
    fn pending_order(&self) -> BoxFuture<'_, StoreResult<Vec<SessionId>>>;

    /// The session's full history, oldest first.
    fn transitions(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Vec<Transition>>>;

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

    /// Records a heartbeat: last seen at `at`, GPU inventory and health as reported.
    /// `false` when the node never registered.
    fn record_sync<'a>(
        &'a self,
        node: &'a NodeName,
        gpus: &'a [GpuInfo],
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<bool>>;

    /// Every registered node with its GPUs, ordered by name.
    fn nodes(&self) -> BoxFuture<'_, StoreResult<Vec<NodeRecord>>>;

    /// Sets a GPU's mode; `None` when no such GPU is registered.
    fn set_gpu_mode<'a>(
        &'a self,
        uuid: &'a GpuUuid,
        mode: GpuMode,
    ) -> BoxFuture<'a, StoreResult<Option<GpuRecord>>>;
}
