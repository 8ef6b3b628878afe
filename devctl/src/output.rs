//! How devctl prints things for people: aligned tables, times in UTC
//! (`2026-11-21 10:00:03Z`), memory as `40.0 GiB`, traffic as `1.5 MiB`. `--json` output is
//! the API's own types, printed by `serde_json`, and does not pass through here.

use std::fmt::{self, Write as _};

use chrono::{DateTime, Utc};
use ongrid_core::api::{AuditRecord, GpuView, Institute, KeyView, NodeView, SessionView, WhoAmI};
use ongrid_core::lifecycle::{LifecycleView, SignalKind};
use ongrid_core::{GpuHealth, GpuRequest, HumanDuration, SessionState, Sharing};

/// A table of left-aligned columns separated by two spaces. The last column is not padded, so
/// lines carry no trailing blanks.
#[derive(Debug, Clone, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self {
            rows: vec![headers.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    /// A table without a header line.
    pub fn bare() -> Self {
        Self::default()
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders each line prefixed by `indent`.
    pub fn render(&self, indent: &str) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0; columns];
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for row in &self.rows {
            let mut line = indent.to_owned();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(cell);
                if i + 1 < row.len() {
                    let pad = widths[i] - cell.chars().count();
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(""))
    }
}

/// A time as devctl prints it: UTC, to the second, `2026-11-21 10:00:03Z`.
pub fn format_time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

/// A request in words: `2 GPUs, capability ≥ 8.0, memory ≥ 40 GB, whole GPUs`.
pub fn describe_request(request: &GpuRequest) -> String {
    let mut out = match request.count {
        1 => "1 GPU".to_owned(),
        n => format!("{n} GPUs"),
    };
    if let Some(capability) = request.min_capability {
        let _ = write!(out, ", capability ≥ {capability}");
    }
    if let Some(memory) = request.min_memory {
        let _ = write!(out, ", memory ≥ {memory}");
    }
    out.push_str(match request.sharing {
        Sharing::Exclusive => ", whole GPUs only",
        Sharing::Shared => ", shared GPUs only",
        Sharing::Any => ", whole or shared",
    });
    out
}

/// The state with its queue position when PENDING: `PENDING (#3 in queue)`.
pub fn describe_state(session: &SessionView) -> String {
    match (session.state, session.queue_position) {
        (SessionState::Pending, Some(position)) => format!("PENDING (#{position} in queue)"),
        (state, _) => state.to_string(),
    }
}

/// What devctl says after creating a session that has to wait for a GPU.
pub fn queue_notice(session: &SessionView) -> Option<String> {
    if session.state != SessionState::Pending {
        return None;
    }
    let position = session
        .queue_position
        .map(|p| format!("queued at position {p}"))
        .unwrap_or_else(|| "queued".to_owned());
    Some(format!(
        "no GPU free now: {position}; it starts when a GPU frees (devctl session show {})",
        session.name
    ))
}

/// `devctl whoami`: who the manager sees, and (from managers that say) the credential: its
/// kind, VOs and FQANs, and how long it has left.
pub fn render_whoami(me: &WhoAmI, now: DateTime<Utc>) -> String {
    let mut table = Table::bare();
    table.row(vec!["dn:".into(), me.dn.to_string()]);
    table.row(vec!["login:".into(), me.user_name.to_string()]);
    table.row(vec!["uid:".into(), me.uid.to_string()]);
    table.row(vec![
        "admin:".into(),
        if me.admin { "yes" } else { "no" }.into(),
    ]);
    if let Some(kind) = me.credential {
        let none = || "-".to_owned();
        let list = |items: &[String]| {
            if items.is_empty() {
                none()
            } else {
                items.join(", ")
            }
        };
        table.row(vec!["credential:".into(), kind.to_string()]);
        table.row(vec!["vo:".into(), list(&me.vos)]);
        table.row(vec!["fqans:".into(), list(&me.fqans)]);
        if let Some(not_after) = me.not_after {
            table.row(vec![
                "time left:".into(),
                format!(
                    "{} (until {})",
                    time_left(not_after, now),
                    format_time(not_after)
                ),
            ]);
        }
    }
    table.to_string()
}

/// How long until `at`, for people: `11h 59m`, `2d 3h`, `45m 10s`, or `expired`.
pub fn time_left(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let seconds = (at - now).num_seconds();
    if seconds <= 0 {
        return "expired".to_owned();
    }
    let (days, hours, minutes, secs) = (
        seconds / 86_400,
        seconds % 86_400 / 3600,
        seconds % 3600 / 60,
        seconds % 60,
    );
    if days > 0 {
        format!("{days}d {hours}h")
    } else if hours > 0 {
        format!("{hours}h {minutes}m")
    } else if minutes > 0 {
        format!("{minutes}m {secs}s")
    } else {
        format!("{secs}s")
    }
}

/// `devctl session show`: the session's fields, its lifecycle, then its transitions.
pub fn render_session(session: &SessionView) -> String {
    render_session_at(session, Utc::now())
}

/// [`render_session`] as of `now` (time left until the deadlines).
pub fn render_session_at(session: &SessionView, now: DateTime<Utc>) -> String {
    let gpus = if session.gpus.is_empty() {
        "-".to_owned()
    } else {
        session
            .gpus
            .iter()
            .map(|g| g.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut fields = Table::bare();
    let mut field = |name: &str, value: String| fields.row(vec![format!("{name}:"), value]);
    field("name", session.name.to_string());
    field(
        "owner",
        format!("{} ({})", session.owner, session.user_name),
    );
    field("state", describe_state(session));
    field("reason", session.reason.clone());
    field(
        "node",
        session
            .node
            .as_ref()
            .map_or_else(|| "-".to_owned(), ToString::to_string),
    );
    field("gpus", gpus);
    field("request", describe_request(&session.request));
    field("image", session.image.clone());
    field("container", session.container.clone());
    field("created", format_time(session.created_at));
    field("id", session.id.to_string());

    let mut transitions = Table::bare();
    for t in &session.transitions {
        transitions.row(vec![
            format_time(t.at),
            t.from.map(|s| s.to_string()).unwrap_or_default(),
            format!("→ {}", t.to),
            t.reason.clone(),
        ]);
    }
    let lifecycle = session
        .lifecycle
        .as_ref()
        .map(|view| render_lifecycle(view, now))
        .unwrap_or_default();
    format!(
        "{fields}{lifecycle}transitions:\n{}",
        transitions.render("  ")
    )
}

fn signal_name(kind: SignalKind) -> &'static str {
    match kind {
        SignalKind::Connection => "ssh connection",
        SignalKind::SshTraffic => "ssh traffic",
        SignalKind::Cpu => "cpu",
        SignalKind::Gpu => "gpu",
        SignalKind::Keep => "keep-alive",
    }
}

/// A deadline for people: `2026-11-21 12:00:00Z (1h 59m left)`.
fn deadline(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if at <= now {
        format!("{} (due now)", format_time(at))
    } else {
        format!("{} ({} left)", format_time(at), time_left(at, now))
    }
}

/// The lifecycle part of `devctl session show`: the deadlines, what keeps the session alive,
/// and when each activity signal was last seen.
pub fn render_lifecycle(view: &LifecycleView, now: DateTime<Utc>) -> String {
    let d = &view.deadlines;
    let mut fields = Table::bare();
    let mut field = |name: &str, value: String| fields.row(vec![format!("{name}:"), value]);
    field(
        "idle timeout",
        HumanDuration(std::time::Duration::from_secs(d.idle_timeout_secs)).to_string(),
    );
    if let Some(end) = d.max_end_at {
        field("ends at", deadline(end, now));
    }
    if let Some(keep) = d.keep_until {
        field("kept until", deadline(keep, now));
    }
    field(
        "next hold",
        match &d.next_hold {
            Some(hold) => format!("{} at {}", hold.reason, deadline(hold.at, now)),
            None => "-".to_owned(),
        },
    );
    field(
        "alive because",
        view.kept_alive_by
            .map_or_else(|| "-".to_owned(), |k| signal_name(k).to_owned()),
    );
    let mut signals = Table::bare();
    for signal in &view.signals {
        signals.row(vec![
            signal_name(signal.kind).to_owned(),
            signal.last_seen.map_or_else(|| "-".to_owned(), format_time),
            signal.detail.clone().unwrap_or_default(),
        ]);
    }
    format!(
        "lifecycle:\n{}  last activity:\n{}",
        fields.render("  "),
        signals.render("    ")
    )
}

/// `devctl session release`: where the session is now.
pub fn render_released(session: &SessionView) -> String {
    match session.state {
        SessionState::Pending => {
            let position = session
                .queue_position
                .map(|p| format!(" at position {p} in the queue"))
                .unwrap_or_default();
            let node = session
                .node
                .as_ref()
                .map(|n| format!(" on {n}"))
                .unwrap_or_default();
            format!(
                "session {} released: PENDING{position}; it restarts in its container{node} when \
                 a GPU frees there (devctl session show {})\n",
                session.name, session.name
            )
        }
        state => format!(
            "session {} released: {state} ({})\n",
            session.name, session.reason
        ),
    }
}

/// `devctl session keep`: until when, and whether the site capped it.
pub fn render_kept(session: &SessionView, asked: HumanDuration, now: DateTime<Utc>) -> String {
    let Some(until) = session
        .lifecycle
        .as_ref()
        .and_then(|l| l.deadlines.keep_until)
    else {
        return format!("session {} kept alive\n", session.name);
    };
    // A minute of slack for the time between the request and now.
    let slack = std::time::Duration::from_secs(60);
    let capped = if until < now + asked.as_duration().saturating_sub(slack) {
        " (the most this site allows)"
    } else {
        ""
    };
    format!(
        "session {} kept alive until {}{capped}\n",
        session.name,
        deadline(until, now)
    )
}

/// `devctl session ls`; with `all`, each session's owner too.
pub fn render_sessions(sessions: &[SessionView], all: bool) -> String {
    if sessions.is_empty() {
        return "no sessions: start one with devctl session new\n".to_owned();
    }
    let mut headers = vec!["NAME", "STATE", "NODE", "GPUS", "CREATED"];
    if all {
        headers.push("OWNER");
    }
    headers.push("REASON");
    let mut table = Table::new(&headers);
    for s in sessions {
        let mut row = vec![
            s.name.to_string(),
            describe_state(s),
            s.node
                .as_ref()
                .map_or_else(|| "-".to_owned(), ToString::to_string),
            s.request.count.to_string(),
            format_time(s.created_at),
        ];
        if all {
            row.push(s.owner.to_string());
        }
        row.push(s.reason.clone());
        table.row(row);
    }
    table.to_string()
}

fn health(node: &NodeView, gpu: &GpuView) -> String {
    match &gpu.info.health {
        GpuHealth::Failed(reason) => format!("FAILED: {reason}"),
        GpuHealth::Healthy if !node.online => {
            format!("node offline since {}", format_time(node.last_seen))
        }
        GpuHealth::Healthy => "ok".to_owned(),
    }
}

/// `devctl gpus`: one row per GPU, nodes in the manager's order; offline nodes are marked.
pub fn render_gpus(nodes: &[NodeView]) -> String {
    if nodes.is_empty() {
        return "no nodes: no node agent has registered with the manager yet\n".to_owned();
    }
    let mut table = Table::new(&[
        "NODE", "GPU", "MODEL", "CC", "MEMORY", "MODE", "USED/CAP", "FREE", "HEALTH", "SESSIONS",
    ]);
    for node in nodes {
        let node_name = if node.online {
            node.name.to_string()
        } else {
            format!("{} (offline)", node.name)
        };
        if node.gpus.is_empty() {
            table.row(vec![node_name.clone(), "(no GPUs)".to_owned()]);
        }
        for gpu in &node.gpus {
            let sessions = gpu
                .sessions
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(",");
            table.row(vec![
                node_name.clone(),
                gpu.info.uuid.to_string(),
                gpu.info.model.clone(),
                gpu.info.capability.to_string(),
                gpu.info.memory.to_string(),
                gpu.mode.to_string(),
                format!("{}/{}", gpu.used, gpu.mode.capacity()),
                gpu.free.to_string(),
                health(node, gpu),
                if sessions.is_empty() {
                    "-".to_owned()
                } else {
                    sessions
                },
            ]);
        }
    }
    table.to_string()
}

/// `devctl admin gpu mode`: the GPU after the change.
pub fn render_gpu_mode(gpu: &GpuView) -> String {
    format!(
        "GPU {} on {} is now {} ({} of {} in use)\n",
        gpu.info.uuid,
        gpu.node,
        gpu.mode,
        gpu.used,
        gpu.mode.capacity()
    )
}

/// A byte count for people: `512 B`, `1.5 KiB`, `12.0 MiB`, `3.2 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.1} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// `ssh-ed25519, alice@laptop`, or the algorithm alone when the key has no comment.
fn key_kind(key: &KeyView) -> String {
    if key.comment.is_empty() {
        key.algorithm.clone()
    } else {
        format!("{}, {}", key.algorithm, key.comment)
    }
}

/// `devctl key add`: what was registered, and until when.
pub fn render_key_added(key: &KeyView, renewed: bool) -> String {
    let done = if renewed {
        "was already yours: renewed"
    } else {
        "added"
    };
    format!(
        "key {} ({}) {done}\nexpires {} (with the certificate or proxy used)\n",
        key.fingerprint,
        key_kind(key),
        format_time(key.expires_at)
    )
}

pub fn render_key_removed(key: &KeyView) -> String {
    format!("key {} ({}) removed\n", key.fingerprint, key_kind(key))
}

/// `devctl key ls`; with `all`, each key's owner too. Keys expired at `now` are marked.
pub fn render_keys(keys: &[KeyView], all: bool, now: DateTime<Utc>) -> String {
    if keys.is_empty() {
        return if all {
            "no SSH keys registered\n".to_owned()
        } else {
            "no SSH keys: register yours with devctl key add\n".to_owned()
        };
    }
    let mut headers = vec!["FINGERPRINT", "TYPE", "COMMENT"];
    if all {
        headers.push("OWNER");
    }
    headers.extend(["ADDED", "EXPIRES"]);
    let mut table = Table::new(&headers);
    for key in keys {
        let mut row = vec![
            key.fingerprint.clone(),
            key.algorithm.clone(),
            if key.comment.is_empty() {
                "-".to_owned()
            } else {
                key.comment.clone()
            },
        ];
        if all {
            row.push(key.owner.to_string());
        }
        let mut expires = format_time(key.expires_at);
        if key.expires_at <= now {
            expires.push_str(" (expired: devctl key add renews it)");
        }
        row.extend([format_time(key.added_at), expires]);
        table.row(row);
    }
    table.to_string()
}

fn networks(institute: &Institute) -> String {
    institute
        .cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn render_institute_added(institute: &Institute) -> String {
    format!(
        "institute {} added: {}\n",
        institute.name,
        networks(institute)
    )
}

pub fn render_institute_removed(institute: &Institute) -> String {
    format!(
        "institute {} removed: {} no longer allowed\n",
        institute.name,
        networks(institute)
    )
}

/// `devctl admin institute show`: the name, then one network per line.
pub fn render_institute(institute: &Institute) -> String {
    let mut table = Table::bare();
    table.row(vec!["name:".into(), institute.name.to_string()]);
    if institute.cidrs.is_empty() {
        table.row(vec!["networks:".into(), "-".into()]);
    }
    for (i, cidr) in institute.cidrs.iter().enumerate() {
        let label = if i == 0 { "networks:" } else { "" };
        table.row(vec![label.into(), cidr.to_string()]);
    }
    table.to_string()
}

/// `devctl admin institute ls`.
pub fn render_institutes(institutes: &[Institute]) -> String {
    if institutes.is_empty() {
        return "no institutes: the SSH gateway accepts no connection until one is added with \
                devctl admin institute add NAME CIDR...\n"
            .to_owned();
    }
    let mut table = Table::new(&["NAME", "NETWORKS"]);
    for institute in institutes {
        table.row(vec![institute.name.to_string(), networks(institute)]);
    }
    table.to_string()
}

/// `devctl admin audit`: one row per connection, in the manager's order (newest first).
/// `filtered` says whether `--user` or `--since` narrowed the list.
pub fn render_audit(records: &[AuditRecord], filtered: bool) -> String {
    if records.is_empty() {
        return if filtered {
            "no SSH connections match --user/--since\n".to_owned()
        } else {
            "no SSH connections recorded\n".to_owned()
        };
    }
    let mut table = Table::new(&[
        "OPENED",
        "CLOSED",
        "USER",
        "KEY",
        "SOURCE",
        "INSTITUTE",
        "SESSION",
        "IN",
        "OUT",
    ]);
    for r in records {
        table.row(vec![
            format_time(r.opened_at),
            r.closed_at.map_or_else(|| "open".to_owned(), format_time),
            r.owner.to_string(),
            r.fingerprint.clone(),
            r.source.to_string(),
            r.institute.to_string(),
            r.session_name.to_string(),
            format_bytes(r.bytes_in),
            format_bytes(r.bytes_out),
        ]);
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::api::{CredentialKind, SessionView};
    use ongrid_core::{
        Cidr, ComputeCapability, Dn, GpuId, GpuInfo, GpuMode, GpuUuid, InstituteName, MemorySize,
        NodeName, SessionId, SessionName, Transition, UserName,
    };

    const UUID_A: &str = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f";
    const UUID_B: &str = "GPU-11111111-2222-3333-4444-555555555502";

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    fn session(name: &str, state: SessionState) -> SessionView {
        SessionView {
            id: SessionId("6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f".parse().unwrap()),
            name: SessionName::parse(name).unwrap(),
            owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            state,
            reason: "placed on node1".into(),
            request: GpuRequest {
                count: 1,
                min_capability: Some(ComputeCapability::new(8, 0)),
                min_memory: Some(MemorySize::parse("40GiB").unwrap()),
                sharing: Sharing::Exclusive,
            },
            image: "ongrid/dev:latest".into(),
            node: Some(NodeName::parse("node1").unwrap()),
            gpus: vec![GpuId::parse(UUID_A).unwrap()],
            container: "ongrid-6f1c2d3e4a5b4c6d8e9f0a1b2c3d4e5f".into(),
            created_at: at(3),
            queue_position: None,
            lifecycle: None,
            transitions: vec![
                Transition {
                    from: None,
                    to: SessionState::Pending,
                    at: at(3),
                    reason: "created".into(),
                },
                Transition {
                    from: Some(SessionState::Pending),
                    to: SessionState::Starting,
                    at: at(4),
                    reason: "placed on node1".into(),
                },
            ],
        }
    }

    fn gpu(uuid: &str, mode: GpuMode, used: u32, health: GpuHealth) -> GpuView {
        GpuView {
            info: GpuInfo {
                uuid: GpuUuid::parse(uuid).unwrap(),
                model: "NVIDIA A100-SXM4-40GB".into(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(40_960),
                pci_bus_id: None,
                driver_version: None,
                mig_enabled: false,
                health,
                utilization_percent: None,
            },
            node: NodeName::parse("node1").unwrap(),
            mode,
            used,
            free: mode.capacity() - used,
            sessions: (0..used)
                .map(|i| SessionName::parse(&format!("s{i}")).unwrap())
                .collect(),
        }
    }

    #[test]
    fn tables_align_columns_without_trailing_blanks() {
        let mut t = Table::new(&["NAME", "STATE", "REASON"]);
        t.row(vec!["train1".into(), "PENDING".into(), "created".into()]);
        t.row(vec!["a".into(), "WAITING".into(), String::new()]);
        assert_eq!(
            t.to_string(),
            "NAME    STATE    REASON\n\
             train1  PENDING  created\n\
             a       WAITING\n"
        );
    }

    #[test]
    fn times_are_utc_to_the_second() {
        assert_eq!(format_time(at(3)), "2026-11-21 10:00:03Z");
    }

    #[test]
    fn session_show_says_why_a_session_is_alive() {
        use ongrid_core::lifecycle::{
            ActivitySignal, HoldReason, LifecycleView, PlannedHold, SessionDeadlines, SignalKind,
        };
        let mut s = session("train1", SessionState::Idle);
        s.lifecycle = Some(LifecycleView {
            deadlines: SessionDeadlines {
                session_id: s.id,
                state: SessionState::Idle,
                idle_timeout_secs: 7200,
                max_end_at: Some(at(7 * 86_400)),
                keep_until: None,
                next_hold: Some(PlannedHold {
                    at: at(3600 + 7200),
                    reason: HoldReason::Idle,
                }),
            },
            signals: vec![
                ActivitySignal {
                    kind: SignalKind::Connection,
                    last_seen: Some(at(600)),
                    detail: Some("none open".into()),
                },
                ActivitySignal {
                    kind: SignalKind::Cpu,
                    last_seen: Some(at(3600)),
                    detail: Some("last sample 97% CPU".into()),
                },
            ],
            kept_alive_by: Some(SignalKind::Cpu),
        });
        let text = render_session_at(&s, at(3600));
        let expected = "lifecycle:\n  idle timeout:   2 hours\n  ends at:        2026-11-28 10:00:00Z (6d 23h left)\n  next hold:      idle at 2026-11-21 13:00:00Z (2h 0m left)\n  alive because:  cpu\n  last activity:\n    ssh connection  2026-11-21 10:10:00Z  none open\n    cpu             2026-11-21 11:00:00Z  last sample 97% CPU\ntransitions:\n";
        assert!(text.contains(expected), "{text}");
    }

    #[test]
    fn session_show_lists_fields_and_transitions() {
        let text = render_session(&session("train1", SessionState::Starting));
        assert_eq!(
            text,
            "name:       train1
owner:      /DC=org/DC=example/CN=Alice Smith (alice-smith)
state:      STARTING
reason:     placed on node1
node:       node1
gpus:       GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f
request:    1 GPU, capability ≥ 8.0, memory ≥ 40.0 GiB, whole GPUs only
image:      ongrid/dev:latest
container:  ongrid-6f1c2d3e4a5b4c6d8e9f0a1b2c3d4e5f
created:    2026-11-21 10:00:03Z
id:         6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f
transitions:
  2026-11-21 10:00:03Z           → PENDING   created
  2026-11-21 10:00:04Z  PENDING  → STARTING  placed on node1
"
        );
    }

    #[test]
    fn pending_sessions_show_their_queue_position() {
        let mut s = session("train2", SessionState::Pending);
        s.queue_position = Some(3);
        assert_eq!(describe_state(&s), "PENDING (#3 in queue)");
        assert_eq!(
            queue_notice(&s).unwrap(),
            "no GPU free now: queued at position 3; it starts when a GPU frees (devctl session \
             show train2)"
        );
        assert_eq!(queue_notice(&session("x", SessionState::Waiting)), None);
    }

    #[test]
    fn session_list_has_owner_only_for_all() {
        let sessions = [
            session("train1", SessionState::Waiting),
            session("dev", SessionState::Held),
        ];
        assert_eq!(
            render_sessions(&sessions, false),
            "NAME    STATE    NODE   GPUS  CREATED               REASON
train1  WAITING  node1  1     2026-11-21 10:00:03Z  placed on node1
dev     HELD     node1  1     2026-11-21 10:00:03Z  placed on node1
"
        );
        let all = render_sessions(&sessions, true);
        assert!(all.lines().next().unwrap().contains("  OWNER  "), "{all}");
        assert!(all.contains("/DC=org/DC=example/CN=Alice Smith"), "{all}");
        assert_eq!(
            render_sessions(&[], false),
            "no sessions: start one with devctl session new\n"
        );
    }

    #[test]
    fn gpu_table_marks_offline_nodes_and_failed_gpus() {
        let offline_gpu = GpuView {
            node: NodeName::parse("node2").unwrap(),
            free: 0,
            ..gpu(UUID_B, GpuMode::Exclusive, 0, GpuHealth::Healthy)
        };
        let nodes = [
            NodeView {
                name: NodeName::parse("node1").unwrap(),
                online: true,
                last_seen: at(0),
                gpu_backend: "simulated".into(),
                gpus: vec![
                    gpu(UUID_A, GpuMode::Exclusive, 1, GpuHealth::Healthy),
                    gpu(
                        UUID_B,
                        GpuMode::Shared { max_sessions: 4 },
                        2,
                        GpuHealth::Failed("fell off the bus".into()),
                    ),
                ],
            },
            NodeView {
                name: NodeName::parse("node2").unwrap(),
                online: false,
                last_seen: at(60),
                gpu_backend: "nvidia-smi".into(),
                gpus: vec![offline_gpu],
            },
            NodeView {
                name: NodeName::parse("node3").unwrap(),
                online: true,
                last_seen: at(60),
                gpu_backend: "nvidia-smi".into(),
                gpus: vec![],
            },
        ];
        let expected = [
            "NODE             GPU                                       MODEL                  CC   MEMORY    MODE       USED/CAP  FREE  HEALTH                                   SESSIONS",
            "node1            GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  1/1       0     ok                                       s0",
            "node1            GPU-11111111-2222-3333-4444-555555555502  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  shared:4   2/4       2     FAILED: fell off the bus                 s0,s1",
            "node2 (offline)  GPU-11111111-2222-3333-4444-555555555502  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  0/1       0     node offline since 2026-11-21 10:01:00Z  -",
            "node3            (no GPUs)",
        ];
        assert_eq!(render_gpus(&nodes), expected.join("\n") + "\n");
        assert_eq!(
            render_gpus(&[]),
            "no nodes: no node agent has registered with the manager yet\n"
        );
    }

    #[test]
    fn whoami_is_a_short_list() {
        let me = WhoAmI {
            dn: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            uid: 20000,
            admin: false,
            credential: None,
            vos: Vec::new(),
            fqans: Vec::new(),
            not_after: None,
        };
        assert_eq!(
            render_whoami(&me, at(0)),
            "dn:     /DC=org/DC=example/CN=Alice Smith\nlogin:  alice-smith\nuid:    20000\nadmin:  no\n"
        );
        let proxy = WhoAmI {
            credential: Some(CredentialKind::Impersonation),
            vos: vec!["myvo".into()],
            fqans: vec![
                "/myvo/Role=NULL/Capability=NULL".into(),
                "/myvo/prod/Role=production/Capability=NULL".into(),
            ],
            not_after: Some(at(12 * 3600 - 61)),
            ..me.clone()
        };
        assert_eq!(
            render_whoami(&proxy, at(0)),
            "dn:          /DC=org/DC=example/CN=Alice Smith\n\
             login:       alice-smith\n\
             uid:         20000\n\
             admin:       no\n\
             credential:  impersonation proxy\n\
             vo:          myvo\n\
             fqans:       /myvo/Role=NULL/Capability=NULL, /myvo/prod/Role=production/Capability=NULL\n\
             time left:   11h 58m (until 2026-11-21 21:58:59Z)\n"
        );
        let plain = WhoAmI {
            credential: Some(CredentialKind::EndEntity),
            not_after: Some(at(-1)),
            ..me
        };
        let text = render_whoami(&plain, at(0));
        assert!(
            text.contains("credential:  end-entity certificate\nvo:          -\nfqans:       -\n"),
            "{text}"
        );
        assert!(
            text.ends_with("time left:   expired (until 2026-11-21 09:59:59Z)\n"),
            "{text}"
        );
    }

    #[test]
    fn time_left_is_short() {
        assert_eq!(time_left(at(3 * 86_400 + 7200 + 5), at(0)), "3d 2h");
        assert_eq!(time_left(at(3600), at(0)), "1h 0m");
        assert_eq!(time_left(at(59 * 60 + 1), at(0)), "59m 1s");
        assert_eq!(time_left(at(5), at(0)), "5s");
        assert_eq!(time_left(at(0), at(0)), "expired");
    }

    fn key(comment: &str, expires: i64) -> KeyView {
        KeyView {
            fingerprint: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".into(),
            algorithm: "ssh-ed25519".into(),
            comment: comment.into(),
            owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            added_at: at(0),
            expires_at: at(expires),
        }
    }

    #[test]
    fn bytes_are_human_readable() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(12 << 20), "12.0 MiB");
        assert_eq!(format_bytes(3_435_973_837), "3.2 GiB");
    }

    #[test]
    fn key_add_says_what_and_until_when() {
        assert_eq!(
            render_key_added(&key("alice@laptop", 86_400), false),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) \
             added\nexpires 2026-11-22 10:00:00Z (with the certificate or proxy used)\n"
        );
        assert_eq!(
            render_key_added(&key("", 60), true),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519) was already \
             yours: renewed\nexpires 2026-11-21 10:01:00Z (with the certificate or proxy used)\n"
        );
        assert_eq!(
            render_key_removed(&key("alice@laptop", 60)),
            "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) \
             removed\n"
        );
    }

    #[test]
    fn key_list_marks_expired_keys_and_owners_for_all() {
        let keys = [key("alice@laptop", 86_400), key("", 60)];
        assert_eq!(
            render_keys(&keys, false, at(120)),
            "FINGERPRINT                                         TYPE         COMMENT       ADDED                 EXPIRES
SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  ssh-ed25519  alice@laptop  2026-11-21 10:00:00Z  2026-11-22 10:00:00Z
SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  ssh-ed25519  -             2026-11-21 10:00:00Z  2026-11-21 10:01:00Z (expired: devctl key add renews it)
"
        );
        let all = render_keys(&keys, true, at(0));
        assert!(all.lines().next().unwrap().contains("  OWNER  "), "{all}");
        assert!(all.contains("/DC=org/DC=example/CN=Alice Smith"), "{all}");
        assert!(!all.contains("expired"), "{all}");
        assert_eq!(
            render_keys(&[], false, at(0)),
            "no SSH keys: register yours with devctl key add\n"
        );
    }

    fn institute(name: &str, cidrs: &[&str]) -> Institute {
        Institute {
            name: InstituteName::parse(name).unwrap(),
            cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect(),
        }
    }

    #[test]
    fn institutes_list_their_networks() {
        let local = institute("local", &["127.0.0.0/8", "::1/128"]);
        assert_eq!(
            render_institute(&local),
            "name:      local\nnetworks:  127.0.0.0/8\n           ::1/128\n"
        );
        assert_eq!(
            render_institutes(&[local.clone(), institute("cern.ch", &["192.0.2.0/24"])]),
            "NAME     NETWORKS\nlocal    127.0.0.0/8, ::1/128\ncern.ch  192.0.2.0/24\n"
        );
        assert_eq!(
            render_institute_added(&local),
            "institute local added: 127.0.0.0/8, ::1/128\n"
        );
        assert_eq!(
            render_institute_removed(&local),
            "institute local removed: 127.0.0.0/8, ::1/128 no longer allowed\n"
        );
        assert!(render_institutes(&[]).starts_with("no institutes: "));
    }

    #[test]
    fn audit_rows_show_open_connections_and_traffic() {
        let record = |closed: Option<i64>, bytes_in: u64, bytes_out: u64| AuditRecord {
            connection_id: "9b2e8a4c-1d3f-4e5a-8b7c-6d5e4f3a2b1c".parse().unwrap(),
            owner: Dn::parse("/DC=org/CN=Alice").unwrap(),
            fingerprint: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".into(),
            source: "192.0.2.7".parse().unwrap(),
            institute: InstituteName::parse("uni-glasgow").unwrap(),
            session_id: SessionId("6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f".parse().unwrap()),
            session_name: SessionName::parse("train1").unwrap(),
            opened_at: at(60),
            closed_at: closed.map(at),
            bytes_in,
            bytes_out,
        };
        let records = [record(None, 0, 0), record(Some(90), 1536, 12 << 20)];
        assert_eq!(
            render_audit(&records, false),
            "OPENED                CLOSED                USER              KEY                                                 SOURCE     INSTITUTE    SESSION  IN       OUT
2026-11-21 10:01:00Z  open                  /DC=org/CN=Alice  SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  192.0.2.7  uni-glasgow  train1   0 B      0 B
2026-11-21 10:01:00Z  2026-11-21 10:01:30Z  /DC=org/CN=Alice  SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  192.0.2.7  uni-glasgow  train1   1.5 KiB  12.0 MiB
"
        );
        assert_eq!(render_audit(&[], false), "no SSH connections recorded\n");
        assert_eq!(
            render_audit(&[], true),
            "no SSH connections match --user/--since\n"
        );
    }
}
