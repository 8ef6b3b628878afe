//! Request and response bodies of the manager's HTTPS API under `/v1`, shared by the manager,
//! the node agents and devctl so that all three agree on the wire format.
//!
//! User routes (TLS client certificate; identity = subject DN):
//! - `GET    /v1/whoami`                       → [`WhoAmI`]
//! - `POST   /v1/sessions`                     [`CreateSession`] → 201 [`SessionView`]
//! - `GET    /v1/sessions[?all=true]`          → `Vec<SessionView>` (own; `all` for admins)
//! - `GET    /v1/sessions/{name}[?owner=DN]`   → [`SessionView`] with its transitions; with
//!   `&wait_for=STATE,...[&timeout=SECONDS]` a long-poll: answered once the session is in one of
//!   the states (like `waiting,connected,idle,failed`), or as it is after the timeout (≤ 60 s)
//! - `DELETE /v1/sessions/{name}[?owner=DN]`   → [`SessionView`] (now ENDED)
//! - `POST   /v1/sessions/{name}/hold[?owner=DN]`    [`crate::holds::HoldRequest`] →
//!   [`SessionView`] (HELD; a reason only for admins holding others' sessions)
//! - `POST   /v1/sessions/{name}/release[?owner=DN]` → [`SessionView`] (PENDING, pinned to its node)
//! - `POST   /v1/sessions/{name}/keep[?owner=DN]`    [`crate::holds::KeepRequest`] → [`SessionView`]
//! - `GET    /v1/nodes`                        → `Vec<NodeView>` with their GPUs
//! - `GET    /v1/nodes/{name}[?wait_empty=true[&timeout=S]]` → [`NodeView`]; with `wait_empty`,
//!   once no session or job holds its GPUs, or after `S` seconds (at most 60)
//! - `PUT    /v1/gpus/{uuid}/mode` (admin)     [`SetGpuMode`] → [`GpuView`]
//! - `POST   /v1/nodes/{name}/drain` (admin)   [`DrainRequest`] → [`NodeView`] (nothing new placed
//!   there; what runs keeps running); `DELETE` the same path → [`NodeView`] (undrained)
//! - `DELETE /v1/nodes/{name}` (admin)         → [`NodeView`] (forgotten; 409 unless it is offline
//!   and nothing of it is left: no session but ENDED ones, no job holding GPUs)
//! - `POST   /v1/gpus/{uuid}/drain` (admin)    [`DrainRequest`] → [`GpuView`]; `DELETE` → undrained
//! - `POST   /v1/keys`                         [`AddKey`] → 201 [`KeyView`] (200 when the key was
//!   already the caller's: its expiry is renewed to the presented certificate's notAfter)
//! - `GET    /v1/keys[?all=true]`              → `Vec<KeyView>` (own; `all` for admins)
//! - `DELETE /v1/keys?fingerprint=SHA256:...`  → [`KeyView`] (own; admins any)
//! - `GET    /v1/institutes` (admin)           → `Vec<Institute>`
//! - `GET    /v1/institutes/{name}` (admin)    → [`Institute`]
//! - `POST   /v1/institutes` (admin)           [`Institute`] → 201 [`Institute`] (409 if it exists)
//! - `DELETE /v1/institutes/{name}` (admin)    → [`Institute`]
//! - `GET    /v1/audit[?user=DN][&since=T]` (admin) → `Vec<AuditRecord>`, newest first; `T` is RFC 3339
//!   or a duration ago such as `2 hours`
//! - `GET    /v1/users` (admin)                → `Vec<UserView>`, removed ones included
//! - `DELETE /v1/users/{dn}[?force=true]` (admin) → [`UserRemoved`]: keys deleted, queued jobs
//!   cancelled, images removed; 409 while a session has not ended or a job runs, unless `force`
//!   (which ends and cancels them); the DN percent-encoded as one path segment
//! - `POST   /v1/users/{dn}/restore` (admin)   → [`UserView`]: a removed user may come back
//! - `POST   /v1/jobs`                         [`crate::job::SubmitJob`] → 201 [`crate::job::JobView`]
//!   (QUEUED; the same 403 for an image that does not exist and for someone else's private one)
//! - `GET    /v1/jobs[?all=true]`              → `Vec<JobView>` in queue order (own; `all` for admins)
//! - `GET    /v1/jobs/{id}`                    → [`crate::job::JobView`] with its transitions and chain
//! - `POST   /v1/jobs/{id}/cancel`             → [`crate::job::JobView`] (CANCELLED)
//! - `POST   /v1/jobs/{id}/halt`               → [`crate::job::JobView`] (MUSTHALT)
//! - `GET    /v1/jobs/{id}/logs[?offset=N]`    → [`crate::job::LogChunk`]: the kept output from byte
//!   `N` (at most 1 MiB; [`crate::job::JOB_LOG_CAP`] per job), `complete` once the job has ended
//!   and nothing follows; with `&wait=true[&timeout=SECONDS]` a long-poll: answered once there
//!   is output from `N` or it is complete, else empty and not complete after the timeout (≤ 60 s)
//! - `GET    /v1/images/{reference}[?owner=DN]` → [`crate::image::ImageView`]; with
//!   `&after=DONE/TOTAL[&timeout=SECONDS]` a long-poll: answered once the image is no longer
//!   BUILDING or its progress is not `DONE/TOTAL` bytes (`0/0` before any), or as it is after the
//!   timeout (≤ 60 s)
//! - `POST   /v1/dashboard/links`              optional [`DashboardLinkRequest`] → 201
//!   [`DashboardLink`]: a single-use login link to the web dashboard (`devctl dashboard`), valid
//!   for a few minutes (refused to limited proxies). With `{"next": "/dashboard/..."}` the browser
//!   lands on that page once logged in (`devctl session web`): a path under `/dashboard/` of at
//!   most 1,024 bytes of visible ASCII (percent-encode the rest), without `//`, a backslash or a
//!   `.` or `..` segment, else 400
//!
//! Agent routes (`Authorization: Bearer <node token>`; the token names the node):
//! - `POST /v1/agent/register` [`RegisterNode`] → [`DesiredState`]
//! - `POST /v1/agent/sync`     [`NodeReport`]   → [`DesiredState`]
//! - `GET  /v1/agent/desired?after=<version>[&timeout=SECONDS]` → [`DesiredState`] as soon as it
//!   differs from that version, else 204 after the timeout (25 s by default, ≤ 300 s): the
//!   long-poll agents keep open between syncs. Every answer with a desired state carries its
//!   version in `ETag`.
//!
//! Gateway routes (`Authorization: Bearer <gateway token>`):
//! - `GET  /v1/gateway/allowlist`   → [`Allowlist`]
//! - `POST /v1/gateway/authorize`   [`KeyCheck`] → [`KeyOwner`], or 401 whose message says why
//!   (unknown key: `devctl key add`; expired: renew the proxy and `devctl key add` again)
//! - `POST /v1/gateway/route`       [`RouteRequest`] → [`Route`], or 404/409 whose message says
//!   what to do (no such session, several sessions, not running: its state and the fix)
//! - `POST /v1/gateway/connections` [`ConnectionEvent`] → 200 [`crate::holds::SessionDeadlines`]
//!   of the session (the gateway uses it for the login banner and the ten-minute warning)
//! - `POST /v1/gateway/keys/check`  [`HeldKeys`] → [`RevokedKeys`]: which keys of the gateway's
//!   open connections were removed or expired since (asked every second; those connections
//!   are then closed with the message)
//!
//! Every error is [`ErrorBody`]: `{"error": {"code": "...", "message": "..."}}`.
//!
//! Bodies people send (sessions, keys, GPU modes, drains, holds, keeps, freezes, jobs,
//! institutes, owners, reservations, and the dashboard's forms) refuse unknown fields: a misspelt
//! or invented field is a 400 (a 422 for a form) naming it, never stored or ignored.
//! The components' bodies (agent registration and reports, gateway requests) and every answer
//! stay lenient, so a manager and its agents and gateway of adjacent versions understand each
//! other during a rolling upgrade.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use std::net::IpAddr;

pub use crate::container::{ContainerLimits, ContainerUser};
use crate::gpu::{Drain, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid};
use crate::names::{Dn, NodeName, SessionId, SessionName, UserName};
use crate::network::InstituteName;
pub use crate::network::{Allowlist, Institute};
use crate::session::{SessionState, Transition};

/// The error envelope of every non-2xx response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable machine-readable code: `bad_request`, `unauthenticated`, `forbidden`,
    /// `not_found`, `conflict`, `unsatisfiable`, `internal`.
    pub code: String,
    /// One line for a person, naming the fix.
    pub message: String,
}

/// A login link to the manager's web dashboard (`POST /v1/dashboard/links`): open
/// `<manager URL><path>` in a browser once, before `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DashboardLink {
    /// The path with its one-time token, like `/dashboard/login?token=...`, and the page to
    /// land on when one was asked for (`&next=/dashboard/sessions/train1/apps/jupyter/`).
    pub path: String,
    pub expires_at: DateTime<Utc>,
}

/// The optional body of `POST /v1/dashboard/links`. No body, an empty body and `{}` all ask for
/// a link to the dashboard's front page.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DashboardLinkRequest {
    /// Where the browser goes once logged in, like `/dashboard/sessions/train1/apps/jupyter/`:
    /// a path under `/dashboard/` (the manager refuses anything else with a 400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoAmI {
    pub dn: Dn,
    /// The login name inside dev containers.
    pub user_name: UserName,
    pub uid: u32,
    pub admin: bool,
    /// What kind of credential this connection presented (absent from older managers).
    #[serde(default)]
    pub credential: Option<CredentialKind>,
    /// The VOs of the credential's verified VOMS attributes, in the order presented.
    #[serde(default)]
    pub vos: Vec<String>,
    /// The verified FQANs, primary first: `/myvo/Role=NULL/Capability=NULL`, ...
    #[serde(default)]
    pub fqans: Vec<String>,
    /// When the presented credential expires: the earliest notAfter of its chain. SSH keys added
    /// with it expire then too.
    #[serde(default)]
    pub not_after: Option<DateTime<Utc>>,
    /// The accounting group the site's policy puts the caller in (absent from older managers).
    #[serde(default)]
    pub group: Option<String>,
    /// The policy rule that admits the caller: `VO atlas`, `DN /DC=...`, `admin`, `any user the
    /// site authenticates`.
    #[serde(default)]
    pub admitted_by: Option<String>,
    /// With a bearer token (`credential` = `token`): its issuer, subject, groups and scopes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<TokenInfo>,
}

/// `PUT /v1/token-links` (`devctl admin user link`): the tokens of an issuer's subject act as
/// the user of a DN, who has used the site before (with a certificate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkToken {
    /// The issuer: its name in the manager's `[[token_issuers]]`, or its `iss` URL.
    pub issuer: String,
    /// The `sub` claim of the user's tokens (`devctl whoami` with the token shows it).
    pub subject: String,
    pub dn: Dn,
}

/// A linked token identity (`GET /v1/token-links`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenLinkView {
    /// The issuer's `iss` URL.
    pub issuer: String,
    /// Its name in the manager's config, while it is listed there.
    #[serde(default)]
    pub issuer_name: Option<String>,
    pub subject: String,
    pub dn: Dn,
    pub linked_at: DateTime<Utc>,
}

/// A verified bearer token (WLCG common JWT profile, SciTokens), as the manager read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    /// The `iss` claim, as the site's config names the issuer.
    pub issuer: String,
    /// The `sub` claim: who the issuer says the bearer is.
    pub subject: String,
    /// `wlcg.groups`: `/cms`, `/cms/uscms`, ... (none in a SciToken).
    #[serde(default)]
    pub groups: Vec<String>,
    /// The `scope` claim's entries: `compute.create`, `compute.read`, ...
    #[serde(default)]
    pub scopes: Vec<String>,
}

/// `GET /v1/share` (`devctl share`): the site's fair share, groups most favoured first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FairShareView {
    /// Whether the site orders waiting requests by fair share (`[fairshare]`); if not, first
    /// come, first served, and the rest is empty.
    pub enabled: bool,
    /// Usage counts half after this long.
    pub half_life_secs: u64,
    pub groups: Vec<GroupShareView>,
}

/// One accounting group's share, usage and priority.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupShareView {
    pub group: String,
    /// Relative share from the config.
    pub share: u32,
    /// Its part of all groups' shares, 0 to 1.
    pub share_fraction: f64,
    /// Cost-weighted GPU-hours, decayed.
    pub usage: f64,
    /// Its part of all usage, 0 to 1.
    pub usage_fraction: f64,
    /// `2^(-usage_fraction / share_fraction)`: 1 unused, 0.5 at its share; higher goes first.
    pub factor: f64,
    /// Its users' usage, most first: every user for admins, the caller alone for others.
    pub users: Vec<UserShareView>,
}

/// One user's decayed cost-weighted GPU-hours.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserShareView {
    pub dn: Dn,
    pub usage: f64,
}

/// The kind of credential a user presented: a plain certificate, an RFC 3820 proxy, or a bearer
/// token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CredentialKind {
    /// A certificate issued by a CA (no proxy).
    EndEntity,
    /// A normal (impersonation) proxy: `grid-proxy-init`, `voms-proxy-init`.
    Impersonation,
    /// A limited proxy (`-limited`): may read, may not register SSH keys unless the site allows.
    Limited,
    /// An independent proxy: its own identity, the proxy's subject.
    Independent,
    /// An OAuth2 bearer token (a WLCG or SciTokens JWT) from an issuer the site trusts.
    Token,
}

impl std::fmt::Display for CredentialKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::EndEntity => "end-entity certificate",
            Self::Impersonation => "impersonation proxy",
            Self::Limited => "limited proxy",
            Self::Independent => "independent proxy",
            Self::Token => "bearer token",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// When absent the manager picks `dev`, `dev-2`, ... (the first free one).
    pub name: Option<SessionName>,
    #[serde(default)]
    pub gpus: GpuRequest,
    /// Docker image of the dev container; the site's default when absent.
    pub image: Option<String>,
    /// Idle timeout of this session in seconds, within the site's maximum; the site's default
    /// when absent.
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
    /// Maximum lifetime of this session in seconds, within the site's maximum; the site's
    /// default when absent.
    #[serde(default)]
    pub max_duration_secs: Option<u64>,
    /// The reservation of the caller's group whose GPUs it runs on, within its window
    /// (`devctl session new --reservation NAME`). Older clients sent it as `?reservation=NAME`,
    /// which the manager still takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionView {
    pub id: SessionId,
    pub name: SessionName,
    pub owner: Dn,
    pub user_name: UserName,
    pub state: SessionState,
    /// Reason of the last transition.
    pub reason: String,
    pub request: GpuRequest,
    pub image: String,
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuId>,
    /// The dev container's name on its node (`ongrid-<id>`).
    pub container: String,
    pub created_at: DateTime<Utc>,
    /// 1-based position among all PENDING sessions of the site, when PENDING.
    pub queue_position: Option<u32>,
    pub transitions: Vec<Transition>,
    /// Deadlines and activity signals; present for live and HELD sessions.
    #[serde(default)]
    pub lifecycle: Option<crate::holds::LifecycleView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: NodeName,
    /// Whether the agent synced recently enough to be given work.
    pub online: bool,
    pub last_seen: DateTime<Utc>,
    /// `nvidia-smi` or `simulated`.
    pub gpu_backend: String,
    pub gpus: Vec<GpuView>,
    /// The version the agent registered with.
    #[serde(default)]
    pub agent_version: String,
    /// Set while an admin has the node drained.
    #[serde(default)]
    pub drain: Option<Drain>,
    /// Sessions holding its GPUs (STARTING, WAITING, CONNECTED, IDLE), of every owner.
    #[serde(default)]
    pub sessions: u32,
    /// Jobs holding GPUs there (RUNNING, MUSTHALT, HALTING).
    #[serde(default)]
    pub jobs: u32,
}

/// What `devctl admin node drain` and `devctl admin gpu drain` send.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// Why, for the people whose work is there; "maintenance" when not given.
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuView {
    pub info: GpuInfo,
    pub node: NodeName,
    pub mode: GpuMode,
    /// Sessions placed on this GPU now.
    pub used: u32,
    /// `mode.capacity() - used`, or 0 when the GPU is unhealthy or drained, or its node offline
    /// or drained.
    pub free: u32,
    /// Names of the sessions on it that the caller may see.
    pub sessions: Vec<SessionName>,
    /// Set while an admin has the GPU drained.
    #[serde(default)]
    pub drain: Option<Drain>,
    /// In `mig` mode: the session on each of its MIG devices (`info.mig_devices`) that has
    /// one, among those the caller may see.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig_sessions: BTreeMap<crate::gpu::MigUuid, SessionName>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetGpuMode {
    pub mode: GpuMode,
}

/// Sent once when an agent starts (and again whenever its GPU inventory changes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterNode {
    pub node: NodeName,
    pub agent_version: String,
    /// `nvidia-smi` or `simulated`.
    pub gpu_backend: String,
    pub gpus: Vec<GpuInfo>,
    /// Where the gateway reaches this agent's stream endpoint, e.g. `wss://node1.example.org:8444`.
    #[serde(default)]
    pub stream_url: Option<String>,
    /// The mode the agent asks a GPU to start in (the simulated backend's `mode`); the manager
    /// gives it only to a GPU it does not know yet, so an admin's later change wins.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub start_modes: BTreeMap<GpuUuid, GpuMode>,
}

/// The agent's periodic heartbeat: what it sees right now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node: NodeName,
    /// Current GPU inventory and health.
    pub gpus: Vec<GpuInfo>,
    /// Every container on the node labelled as ongrid's, whatever its state.
    pub containers: Vec<ObservedContainer>,
    /// Activity of the running session containers over the last sampling interval.
    #[serde(default)]
    pub activity: Vec<crate::holds::ContainerActivity>,
    /// Progress of the freezes ordered in [`DesiredState::freezes`].
    #[serde(default)]
    pub freezes: Vec<crate::image::FreezeProgress>,
    /// Every job of [`DesiredState::jobs`] the agent knows, and jobs it still has a container
    /// of that the manager no longer lists.
    #[serde(default)]
    pub jobs: Vec<crate::job::ObservedJob>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedContainer {
    pub session_id: SessionId,
    pub container_id: String,
    pub state: ContainerState,
    /// A problem the agent met converging this session (image missing, create failed, ...).
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ContainerState {
    Created,
    Running,
    /// Stopped; `exit_code` and Docker's error text when it died by itself.
    Exited {
        exit_code: i64,
        oom_killed: bool,
        error: Option<String>,
    },
    /// The agent could not create it; `error` on the [`ObservedContainer`] says why.
    Missing,
}

/// What the manager wants on one node. Agents converge to it: containers of sessions listed
/// `Running` are created and started, those listed `Stopped` are stopped and kept, any other
/// ongrid container on the node is removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredState {
    pub node: NodeName,
    /// How often the agent should sync, in seconds.
    pub sync_interval_secs: u64,
    pub sessions: Vec<DesiredSession>,
    /// Freezes to run (or keep running) on this node.
    #[serde(default)]
    pub freezes: Vec<crate::image::FreezeOrder>,
    /// Docker images of frozen images removed with `devctl image rm` (recently: the list is
    /// bounded by a retention window), which must not exist on the node: the agent untags each
    /// it has, so a removed image cannot start sessions any more.
    #[serde(default)]
    pub removed_images: Vec<String>,
    /// Batch jobs to run, halt or kill on this node.
    #[serde(default)]
    pub jobs: Vec<crate::job::DesiredJob>,
    /// The MIG layout of each of the node's GPUs in `mig` mode: the agent makes it once nothing
    /// uses the GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig_layouts: BTreeMap<GpuUuid, crate::mig::MigLayout>,
    /// The node's GPUs in `exclusive` or `shared` mode that its agent last reported in MIG
    /// mode: the agent destroys their MIG instances and turns MIG mode off once nothing uses
    /// them, so they are whole GPUs again.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub mig_off: BTreeSet<GpuUuid>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredSession {
    pub session_id: SessionId,
    pub name: SessionName,
    pub owner: Dn,
    pub user: ContainerUser,
    pub image: String,
    pub gpus: Vec<GpuId>,
    pub run: RunState,
    pub limits: ContainerLimits,
    /// Extra labels the manager wants on the container (besides the agent's own).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The session is starting again after a hold: a stopped container of it is to be started
    /// (or recreated for other GPUs), not taken for one that died by itself. The manager says
    /// so because an agent that restarted during a release no longer knows it stopped it.
    #[serde(default)]
    pub resume: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Running,
    Stopped,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddKey {
    /// One line in OpenSSH's format: `ssh-ed25519 AAAA... comment`.
    pub public_key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyView {
    /// `SHA256:<base64>`, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
    /// `ssh-ed25519`, `ecdsa-sha2-nistp256`, `ssh-rsa`, ...
    pub algorithm: String,
    pub comment: String,
    pub owner: Dn,
    pub added_at: DateTime<Utc>,
    /// The notAfter of the certificate (or proxy) it was registered with; refused after it.
    pub expires_at: DateTime<Utc>,
}

/// The gateway asks whom a public key belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyCheck {
    /// The key as the client offered it, in OpenSSH's one-line format.
    pub public_key: String,
    /// The client's address (normalised), for the log and the throttle.
    pub source: IpAddr,
    /// The SSH user name the client gave.
    pub login: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyOwner {
    pub owner: Dn,
    pub user_name: UserName,
    pub fingerprint: String,
    pub expires_at: DateTime<Utc>,
}

/// The gateway asks which session an SSH user name reaches for this owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub owner: Dn,
    /// The SSH user name: a session name, or anything when the owner has exactly one session.
    pub target: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub session_id: SessionId,
    pub session_name: SessionName,
    pub state: SessionState,
    pub node: NodeName,
    pub container: String,
    /// The agent's stream endpoint base, e.g. `wss://node1.example.org:8444`.
    pub agent_url: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionEventKind {
    Open,
    /// Periodic report of an open connection's byte totals (SSH traffic as activity).
    Activity,
    Close,
}

/// An SSH connection reaching a session opened or closed. `bytes_*` are totals so far
/// (0 on open); `in` is from the client to the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionEvent {
    pub connection_id: uuid::Uuid,
    pub event: ConnectionEventKind,
    pub at: DateTime<Utc>,
    pub owner: Dn,
    pub fingerprint: String,
    pub source: IpAddr,
    pub institute: InstituteName,
    pub session_id: SessionId,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// On a close the gateway made itself (the key was removed or expired): why, as the user
    /// was told. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<String>,
}

/// One connection as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub connection_id: uuid::Uuid,
    pub owner: Dn,
    pub fingerprint: String,
    pub source: IpAddr,
    pub institute: InstituteName,
    pub session_id: SessionId,
    pub session_name: SessionName,
    pub opened_at: DateTime<Utc>,
    /// `None` while the connection is open.
    pub closed_at: Option<DateTime<Utc>>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Why the gateway closed it, when it did (a removed or expired key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<String>,
}

/// The keys of the gateway's open connections, each with the owner it authenticated as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldKeys {
    pub keys: Vec<HeldKey>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeldKey {
    /// `SHA256:...`
    pub fingerprint: String,
    pub owner: Dn,
}

/// Those of [`HeldKeys`] that no longer let anyone in; the others are left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedKeys {
    pub revoked: Vec<RevokedKey>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedKey {
    pub key: HeldKey,
    pub why: Revocation,
    /// When: the expiry, or when the manager found the key gone.
    pub at: DateTime<Utc>,
    /// One line for the user, naming the fix.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Revocation {
    /// No longer registered (or registered to someone else now).
    Removed,
    /// Past the expiry of the certificate or proxy it was registered with.
    Expired,
}

/// A user as admins see them (`GET /v1/users`): the login name and UID the manager gave their
/// DN, whether an admin removed them, and what admins did to them, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserView {
    pub dn: Dn,
    pub user_name: UserName,
    pub uid: u32,
    /// Set while they are removed (`devctl admin user rm`).
    pub removed_at: Option<DateTime<Utc>>,
    /// The admin who removed them.
    pub removed_by: Option<Dn>,
    #[serde(default)]
    pub events: Vec<UserEvent>,
}

/// One admin action on a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserEvent {
    pub at: DateTime<Utc>,
    pub action: UserAction,
    /// The admin's DN.
    pub by: Dn,
    /// What went with it, in words.
    pub details: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UserAction {
    Removed,
    Restored,
}

/// The answer of `DELETE /v1/users/{dn}`: the user, now removed, and what went with them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRemoved {
    pub user: UserView,
    /// Fingerprints of the keys deleted.
    pub keys: Vec<String>,
    /// Sessions ended.
    pub sessions: Vec<SessionName>,
    /// Jobs cancelled.
    pub jobs: Vec<crate::job::JobId>,
    /// Images removed, as `name:version`.
    pub images: Vec<String>,
}

/// The GPU identifiers a container is given, as `CUDA_VISIBLE_DEVICES`/`NVIDIA_VISIBLE_DEVICES`
/// take them: comma-separated UUIDs.
pub fn visible_devices(gpus: &[GpuId]) -> String {
    gpus.iter().map(GpuId::as_str).collect::<Vec<_>>().join(",")
}

/// Parent GPU UUIDs of a list of assigned devices (for a MIG device, not known here: skipped).
pub fn whole_gpus(gpus: &[GpuId]) -> Vec<GpuUuid> {
    gpus.iter()
        .filter_map(|g| match g {
            GpuId::Gpu(uuid) => Some(uuid.clone()),
            GpuId::Mig(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_shape() {
        let body = ErrorBody {
            error: ErrorDetail {
                code: "not_found".into(),
                message: "no session train1".into(),
            },
        };
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"error":{"code":"not_found","message":"no session train1"}}"#
        );
    }

    #[test]
    fn container_state_shape() {
        let s = ContainerState::Exited {
            exit_code: 137,
            oom_killed: true,
            error: None,
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(
            json,
            r#"{"status":"exited","exit_code":137,"oom_killed":true,"error":null}"#
        );
        let back: ContainerState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn visible_devices_joins_uuids() {
        let a = GpuId::parse("GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f").unwrap();
        let b = GpuId::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd").unwrap();
        assert_eq!(
            visible_devices(&[a, b]),
            "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f,MIG-c7384736-a75d-5afc-978f-d2f1294409fd"
        );
    }
}
