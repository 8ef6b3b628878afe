//! The dashboard's HTML, written with maud (escaped by default). Pure: every function takes
//! what it shows and returns markup; [`super::data`] loads it.
//!
//! Accessibility: every input has a `<label>`, every table a caption and header cells, every
//! state is written out as text (colour only repeats it), buttons are real `<button>`s inside
//! forms (keyboard and screen readers work without JavaScript), live regions are
//! `aria-live="polite"`. The page is one column that fits a laptop screen; wide tables scroll
//! inside their own box.

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use ongrid_core::api::{AuditRecord, SessionView};
use ongrid_core::holds::SignalKind;
use ongrid_core::image::{ImageState, ImageView};
use ongrid_core::{Dn, GpuHealth, Institute, SessionState};

use crate::app::logins::NextPath;
use crate::config::DashboardConfig;
use crate::domain::jobs::JobRecord;
use crate::store::NodeRecord;

/// Which page a form came from, so its answer goes back there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Page {
    User,
    Admin,
}

impl Page {
    pub fn path(self) -> &'static str {
        match self {
            Self::User => "/dashboard/",
            Self::Admin => "/dashboard/admin",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Admin => "admin",
        }
    }
}

/// Who the page is for, as the header shows them.
pub struct Header<'a> {
    pub user_name: &'a str,
    pub dn: &'a Dn,
    pub admin: bool,
    /// Logged in with a link (a logout button), not a certificate.
    pub cookie_login: bool,
    pub csrf: &'a str,
    pub notice: Option<&'a str>,
}

fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M UTC").to_string()
}

/// "in 12 min", "3 h 5 min ago".
fn relative(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (at - now).num_seconds();
    let span = secs.unsigned_abs();
    let text = if span < 60 {
        format!("{span} s")
    } else if span < 3600 {
        format!("{} min", span / 60)
    } else if span < 48 * 3600 {
        format!("{} h {} min", span / 3600, span % 3600 / 60)
    } else {
        format!("{} days", span / 86400)
    };
    if secs >= 0 {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

fn bytes(n: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if n >= 1024 * 1024 * 1024 {
        format!("{:.1} GiB", n as f64 / MIB / 1024.0)
    } else {
        format!("{:.1} MiB", n as f64 / MIB)
    }
}

fn signal_name(kind: SignalKind) -> &'static str {
    match kind {
        SignalKind::Connection => "an open SSH connection",
        SignalKind::SshTraffic => "SSH traffic",
        SignalKind::Cpu => "CPU use",
        SignalKind::Gpu => "GPU use",
        SignalKind::Keep => "a keep-alive",
    }
}

fn state_class(state: SessionState) -> String {
    format!("state state-{}", state.to_string().to_lowercase())
}

/// What identifies a rendering of a live part: the event id of the live updates
/// ([`super::live`]), so a page or a reconnecting browser is sent only what it does not have.
pub fn digest(html: &str) -> String {
    use sha2::Digest as _;
    hex::encode(&sha2::Sha256::digest(html.as_bytes())[..12])
}

/// The part of a page its live updates replace, marked with the digest of what it holds.
fn live_region(live: Markup) -> Markup {
    let html = live.into_string();
    html! {
        div id="live" aria-live="polite" data-have=(digest(&html)) { (maud::PreEscaped(html)) }
    }
}

/// The hidden CSRF field of every state-changing form.
fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// A table in its own scrolling box: the caption, a header cell for each column, then a row
/// saying `empty` (when set: the table has no rows) or the rows.
fn table(id: &str, caption: Markup, columns: &[&str], empty: Option<&str>, rows: Markup) -> Markup {
    html! {
        div class="scroll" {
            table id=(id) {
                caption { (caption) }
                thead { tr { @for column in columns { th scope="col" { (column) } } } }
                tbody {
                    @if let Some(empty) = empty { tr { td colspan=(columns.len()) { (empty) } } }
                    (rows)
                }
            }
        }
    }
}

/// `columns`, with an Owner column after the first one in the admins' view (`all`).
fn with_owner<'a>(all: bool, columns: &[&'a str]) -> Vec<&'a str> {
    let mut columns = columns.to_vec();
    if all {
        columns.insert(1, "Owner");
    }
    columns
}

/// The whole page around `main`.
pub fn layout(
    title: &str,
    header: Option<&Header<'_>>,
    live: Option<&str>,
    main: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · ongrid" }
                link rel="stylesheet" href="/dashboard/static/dashboard.css";
                script src="/dashboard/static/dashboard.js" defer {}
            }
            body data-live=[live] {
                a class="skip" href="#main" { "Skip to content" }
                header {
                    p class="brand" { "ongrid" }
                    @if let Some(h) = header {
                        nav aria-label="Pages" {
                            a href="/dashboard/" { "My sessions" }
                            @if h.admin {
                                " " a href="/dashboard/admin" { "Site (admin)" }
                            }
                        }
                        p class="who" {
                            "Logged in as " strong { (h.user_name) }
                            @if h.admin { " (admin)" }
                            span class="dn" { " " (h.dn.as_str()) }
                        }
                        @if h.cookie_login {
                            form method="post" action="/dashboard/logout" class="inline" {
                                (csrf_field(h.csrf))
                                button type="submit" { "Log out" }
                            }
                        }
                    }
                }
                main id="main" {
                    h1 { (title) }
                    @if let Some(notice) = header.and_then(|h| h.notice) {
                        p class="notice" role="status" { (notice) }
                    }
                    (main)
                }
            }
        }
    }
}

/// The page a browser without a login gets (401).
pub fn logged_out(message: &str) -> Markup {
    layout(
        "Log in",
        None,
        None,
        html! {
            p class="error" role="alert" { (message) }
            p { "On a machine with your grid credential, run:" }
            pre { code { "devctl dashboard" } }
            p { "and open the link it prints in this browser within five minutes. Each link works once." }
        },
    )
}

/// An error page with what to do.
pub fn error_page(status: StatusCode, message: &str) -> Markup {
    let title = match status {
        StatusCode::FORBIDDEN => "Not allowed",
        StatusCode::NOT_FOUND => "Not found",
        StatusCode::CONFLICT => "Not possible now",
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "Please check the form",
        _ => "Something went wrong",
    };
    layout(
        title,
        None,
        None,
        html! {
            p class="error" role="alert" { (message) }
            p { a href="/dashboard/" { "Back to your sessions" } }
        },
    )
}

/// `GET /dashboard/login?token=...[&next=PATH]`: the button that spends the link, and then
/// goes to `next`.
pub fn login_page(dn: &Dn, token: &str, next: Option<&NextPath>) -> Markup {
    layout(
        "Log in",
        None,
        None,
        html! {
            p { "This link logs this browser in as " strong { (dn.as_str()) } "." }
            form method="post" action="/dashboard/login" {
                input type="hidden" name="token" value=(token);
                @if let Some(next) = next {
                    input type="hidden" name="next" value=(next.as_str());
                }
                button type="submit" id="log-in" { "Log in" }
            }
        },
    )
}

/// The ssh command that reaches a session through the gateway.
fn ssh_command(config: &DashboardConfig, session: &str) -> String {
    let host = config.ssh_host.as_deref().unwrap_or("<gateway>");
    match config.ssh_port {
        Some(port) if port != 22 => format!("ssh -p {port} {session}@{host}"),
        _ => format!("ssh {session}@{host}"),
    }
}

/// One session's buttons: hold, release, keep, remove, as its state allows.
fn session_actions(view: &SessionView, csrf: &str, page: Page, owner: Option<&Dn>) -> Markup {
    let base = format!("/dashboard/sessions/{}", view.name);
    let owner_field = html! {
        input type="hidden" name="back" value=(page.key());
        @if let Some(owner) = owner { input type="hidden" name="owner" value=(owner.as_str()); }
    };
    let name = view.name.to_string();
    html! {
        div class="actions" {
            @if view.state.is_live() {
                form method="post" action={(base) "/hold"} {
                    (csrf_field(csrf)) (owner_field)
                    @if owner.is_some() {
                        label for={"hold-" (view.user_name.as_str()) "-" (name)} { "Why (shown to " (view.user_name.as_str()) ")" }
                        input id={"hold-" (view.user_name.as_str()) "-" (name)} name="reason" required size="12";
                    }
                    button type="submit" aria-label={"Hold " (name)} { "Hold" }
                }
                form method="post" action={(base) "/keep"} {
                    (csrf_field(csrf)) (owner_field)
                    label for={"keep-" (view.user_name.as_str()) "-" (name)} { "Keep alive for" }
                    input id={"keep-" (view.user_name.as_str()) "-" (name)} name="duration" value="4h" size="5";
                    button type="submit" aria-label={"Keep " (name) " alive"} { "Keep" }
                }
            }
            @if view.state == SessionState::Held {
                form method="post" action={(base) "/release"} {
                    (csrf_field(csrf)) (owner_field)
                    button type="submit" aria-label={"Release " (name)} { "Release" }
                }
            }
            @if view.state != SessionState::Ended {
                form method="post" action={(base) "/remove"} data-confirm={"Remove session " (name) "? Its container and the changes in it are deleted (your home volume stays)."} {
                    (csrf_field(csrf)) (owner_field)
                    button type="submit" class="danger" aria-label={"Remove " (name)} { "Remove" }
                }
            }
        }
    }
}

/// Deadlines and why the session is alive, in words.
fn lifecycle(view: &SessionView, now: DateTime<Utc>) -> Markup {
    let Some(life) = &view.lifecycle else {
        return html! { "—" };
    };
    let d = &life.deadlines;
    html! {
        ul class="plain" {
            @if let Some(next) = &d.next_hold {
                li { "Held " (relative(next.at, now)) " (" (next.reason) ")" }
            }
            @if let Some(end) = d.max_end_at {
                li { "Ends at the latest " (time(end)) }
            }
            @if let Some(keep) = d.keep_until {
                @if keep > now { li { "Kept alive until " (time(keep)) } }
            }
            @if view.state.is_live() {
                li {
                    "Alive because of: "
                    @match life.kept_alive_by {
                        Some(kind) => { (signal_name(kind)) }
                        None => { "nothing right now (it will be held when its idle time is up)" }
                    }
                }
            }
        }
    }
}

/// The sessions table; `all` adds the owner column (admins' view).
pub fn sessions_table(
    sessions: &[SessionView],
    config: &DashboardConfig,
    csrf: &str,
    page: Page,
    now: DateTime<Utc>,
) -> Markup {
    let all = page == Page::Admin;
    let caption =
        html! { @if all { "Every session" } @else { "Your sessions" } " (" (sessions.len()) ")" };
    let columns = [
        "Name",
        "State",
        "Node and GPUs",
        "Deadlines",
        "Connect",
        "Actions",
    ];
    let empty = sessions.is_empty().then_some("No sessions.");
    let rows = html! {
        @for s in sessions {
            tr data-session=(s.name.as_str()) data-state=(s.state.to_string()) {
                th scope="row" { (s.name.as_str()) }
                @if all { td { (s.user_name.as_str()) } }
                td {
                    span class=(state_class(s.state)) { (s.state.to_string()) }
                    @if let Some(position) = s.queue_position { " (queue position " (position) ")" }
                    br; small { (s.reason) }
                }
                td {
                    @match &s.node { Some(node) => { (node.as_str()) } None => { "not placed" } }
                    @for gpu in &s.gpus { br; small { code { (gpu.to_string()) } } }
                }
                td { (lifecycle(s, now)) }
                td {
                    @if s.state.holds_gpus() {
                        code class="ssh" { (ssh_command(config, s.name.as_str())) }
                    } @else { "—" }
                    @if !all && matches!(s.state, SessionState::Waiting | SessionState::Connected | SessionState::Idle) {
                        br;
                        a class="jupyter" href=(format!("/dashboard/sessions/{}/apps/jupyter/", s.name))
                            target="_blank" rel="noopener" { "Open JupyterLab" }
                        " · "
                        a href=(format!("/dashboard/sessions/{}/apps/", s.name)) { "Web apps" }
                    }
                }
                td { (session_actions(s, csrf, page, all.then_some(&s.owner))) }
            }
        }
    };
    table("sessions", caption, &with_owner(all, &columns), empty, rows)
}

/// The images table with a freeze's progress.
pub fn images_table(images: &[ImageView], all: bool) -> Markup {
    let caption =
        html! { @if all { "Every image" } @else { "Your images" } " (" (images.len()) ")" };
    let columns = ["Image", "State", "Progress", "From session", "Where"];
    let empty = images.is_empty().then_some("No images yet.");
    let rows = html! {
        @for image in images {
            tr data-image=(image.reference) data-state=(image.state.to_string()) {
                th scope="row" { (image.reference) }
                @if all { td { (image.user_name.as_str()) } }
                td { span class={"state state-" (image.state.to_string().to_lowercase())} { (image.state.to_string()) }
                     @if image.state == ImageState::Failed { br; small { (image.reason) } } }
                td {
                    @match (&image.progress, image.state) {
                        (Some(p), ImageState::Building) if p.bytes_total > 0 => {
                            @let percent = p.bytes_done.saturating_mul(100) / p.bytes_total;
                            progress max=(p.bytes_total) value=(p.bytes_done.min(p.bytes_total)) aria-label={"Freeze of " (image.reference)} { (percent) "%" }
                            " " span class="progress-text" { (bytes(p.bytes_done)) " of " (bytes(p.bytes_total)) " (" (percent) "%)" }
                        }
                        (_, ImageState::Building) => { span class="progress-text" { "starting…" } }
                        (_, ImageState::Ready) => { @if let Some(size) = image.size { (bytes(size)) } }
                        _ => { "—" }
                    }
                }
                td { (image.session.as_str()) }
                td {
                    @if let Some(docker) = &image.docker_image { code { (docker) } }
                    @if let Some(sif) = &image.sif_path { br; small { code { (sif) } } }
                }
            }
        }
    };
    table("images", caption, &with_owner(all, &columns), empty, rows)
}

/// The jobs table with links to their output.
pub fn jobs_table(jobs: &[JobRecord], csrf: &str, page: Page) -> Markup {
    let all = page == Page::Admin;
    let caption = html! { @if all { "Every job" } @else { "Your jobs" } " (" (jobs.len()) ")" };
    let columns = ["Job", "State", "Image", "Node", "Output", "Actions"];
    let empty = jobs.is_empty().then_some("No jobs.");
    let rows = html! {
        @for job in jobs {
            @let state = job.state();
            tr data-job=(job.id.to_string()) {
                th scope="row" { (job.id.to_string()) }
                @if all { td { (job.user_name.as_str()) } }
                td { span class={"state state-" (state.to_string().to_lowercase())} { (state.to_string()) }
                     br; small { (job.lifecycle.last().reason.to_string()) }
                     @if let Some(code) = job.exit_code { br; small { "exit code " (code) } } }
                td { code { (job.spec.image.to_string()) } }
                td { @match &job.node { Some(n) => { (n.as_str()) } None => { "—" } } }
                td { a href={"/dashboard/jobs/" (job.id.to_string())} { "Output (" (bytes(job.log_size)) ")" } }
                td {
                    @if !state.is_final() {
                        form method="post" action={"/dashboard/jobs/" (job.id.to_string()) "/cancel"} {
                            (csrf_field(csrf))
                            input type="hidden" name="back" value=(page.key());
                            button type="submit" class="danger" aria-label={"Cancel job " (job.id.to_string())} { "Cancel" }
                        }
                    } @else {
                        form method="post" action={"/dashboard/jobs/" (job.id.to_string()) "/remove"} {
                            (csrf_field(csrf))
                            input type="hidden" name="back" value=(page.key());
                            button type="submit" class="danger" aria-label={"Remove job " (job.id.to_string()) " and its output"} { "Remove" }
                        }
                    }
                }
            }
        }
    };
    table("jobs", caption, &with_owner(all, &columns), empty, rows)
}

/// What the user page keeps up to date.
pub fn user_live(
    sessions: &[SessionView],
    images: &[ImageView],
    jobs: &[JobRecord],
    config: &DashboardConfig,
    csrf: &str,
    now: DateTime<Utc>,
) -> Markup {
    html! {
        (sessions_table(sessions, config, csrf, Page::User, now))
        h2 { "Images" }
        (images_table(images, false))
        h2 { "Batch jobs" }
        (jobs_table(jobs, csrf, Page::User))
        p class="updated" { "As of " (time(now)) }
    }
}

/// The user page: the live part, then the forms.
pub fn user_page(header: &Header<'_>, live: Markup, session_names: &[String]) -> Markup {
    let csrf = header.csrf;
    layout(
        "Your sessions",
        Some(header),
        Some("user"),
        html! {
            (live_region(live))
            section aria-labelledby="new-session" {
                h2 id="new-session" { "Start a session" }
                form method="post" action="/dashboard/sessions" class="grid" {
                    (csrf_field(csrf))
                    label for="new-name" { "Name (optional)" }
                    input id="new-name" name="name" placeholder="dev" pattern="[a-z][a-z0-9-]*";
                    label for="new-gpus" { "GPUs" }
                    input id="new-gpus" name="gpus" type="number" min="1" max="16" value="1" required;
                    label for="new-memory" { "Minimum GPU memory (optional)" }
                    input id="new-memory" name="min_memory" placeholder="40GiB";
                    label for="new-image" { "Image (optional)" }
                    input id="new-image" name="image" placeholder="the site's default";
                    button type="submit" id="start-session" { "Start session" }
                }
            }
            section aria-labelledby="freeze" {
                h2 id="freeze" { "Freeze a session into an image" }
                p { "The session keeps running (it pauses briefly for a snapshot). Your home directory is not part of the image." }
                form method="post" action="/dashboard/freeze" class="grid" {
                    (csrf_field(csrf))
                    label for="freeze-session" { "Session" }
                    input id="freeze-session" name="session" list="session-names" required;
                    datalist id="session-names" { @for name in session_names { option value=(name) {} } }
                    label for="freeze-tag" { "Tag" }
                    input id="freeze-tag" name="tag" placeholder="mymodel:v1" required;
                    label for="freeze-force" { "Move the tag if it exists" }
                    input id="freeze-force" name="force" type="checkbox" value="true";
                    button type="submit" id="freeze-session-button" { "Freeze" }
                }
            }
        },
    )
}

fn health(health: &GpuHealth) -> String {
    match health {
        GpuHealth::Healthy => "healthy".to_owned(),
        GpuHealth::Failed(why) => format!("FAILED: {why}"),
        GpuHealth::Unknown(why) => format!("UNKNOWN: {why}"),
    }
}

/// Nodes and their GPUs with drain buttons.
pub fn nodes_table(
    nodes: &[NodeRecord],
    online: &dyn Fn(&NodeRecord) -> bool,
    csrf: &str,
) -> Markup {
    let columns = [
        "Node / GPU",
        "Status",
        "Model, mode, slices",
        "Health",
        "Drain",
    ];
    let empty = nodes.is_empty().then_some("No nodes registered.");
    let rows = html! {
        @for node in nodes {
            tr class="node" data-node=(node.name.as_str()) {
                th scope="row" { (node.name.as_str()) }
                td { @if online(node) { "online" } @else { "OFFLINE" } br; small { "last seen " (time(node.last_seen)) } }
                td { (node.gpus.len()) " GPUs" }
                td { "—" }
                td { (drain_form(&format!("/dashboard/admin/nodes/{}", node.name), node.drain.as_ref(), csrf, node.name.as_str())) }
            }
            @for gpu in node.gpus.iter() {
                tr class="gpu" {
                    th scope="row" { small { code { (gpu.info.uuid.as_str()) } } }
                    td { @if let Some(p) = gpu.info.utilization_percent { (p) "% busy" } }
                    td {
                        (gpu.info.model) ", " (gpu.info.memory.to_string()) br;
                        small { "mode: " (gpu.mode.to_string()) }
                        @for mig in &gpu.info.mig_devices { br; small { "slice " (mig.profile.to_string()) } }
                    }
                    td { (health(&gpu.info.health)) }
                    td { (drain_form(&format!("/dashboard/admin/gpus/{}", gpu.info.uuid.as_str()), gpu.drain.as_ref(), csrf, gpu.info.uuid.as_str())) }
                }
            }
        }
    };
    table("nodes", html! { "Nodes and GPUs" }, &columns, empty, rows)
}

fn drain_form(
    base: &str,
    drain: Option<&ongrid_core::gpu::Drain>,
    csrf: &str,
    what: &str,
) -> Markup {
    let id = format!(
        "drain-{}",
        what.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    );
    html! {
        @match drain {
            Some(d) => {
                "DRAINED by " (d.by) " " (time(d.since)) ": " (d.reason)
                form method="post" action={(base) "/undrain"} {
                    (csrf_field(csrf))
                    button type="submit" aria-label={"Undrain " (what)} { "Undrain" }
                }
            }
            None => {
                "in service"
                form method="post" action={(base) "/drain"} {
                    (csrf_field(csrf))
                    label for=(id) class="visually-hidden" { "Why drain " (what) }
                    input id=(id) name="reason" placeholder="reason";
                    button type="submit" aria-label={"Drain " (what)} { "Drain" }
                }
            }
        }
    }
}

/// What the admin page keeps up to date.
pub fn admin_live(
    sessions: &[SessionView],
    jobs: &[JobRecord],
    nodes: Markup,
    config: &DashboardConfig,
    csrf: &str,
    now: DateTime<Utc>,
) -> Markup {
    html! {
        (sessions_table(sessions, config, csrf, Page::Admin, now))
        h2 { "Batch jobs" }
        (jobs_table(jobs, csrf, Page::Admin))
        h2 { "Nodes and GPUs" }
        (nodes)
        p class="updated" { "As of " (time(now)) }
    }
}

/// The audit log's filter, as the form shows it.
pub struct AuditFilterForm<'a> {
    pub user: &'a str,
    pub since: &'a str,
}

/// The admin page.
pub fn admin_page(
    header: &Header<'_>,
    live: Markup,
    institutes: &[Institute],
    audit: &[AuditRecord],
    filter: &AuditFilterForm<'_>,
) -> Markup {
    let csrf = header.csrf;
    let institute_rows = html! {
        @for inst in institutes {
            tr data-institute=(inst.name.to_string()) {
                th scope="row" { (inst.name.to_string()) }
                td { @for (i, cidr) in inst.cidrs.iter().enumerate() { @if i > 0 { ", " } code { (cidr.to_string()) } } }
                td {
                    form method="post" action={"/dashboard/admin/institutes/" (inst.name.to_string()) "/remove"} data-confirm={"Remove institute " (inst.name.to_string()) "?"} {
                        (csrf_field(csrf))
                        button type="submit" class="danger" aria-label={"Remove institute " (inst.name.to_string())} { "Remove" }
                    }
                }
            }
        }
    };
    let audit_rows = html! {
        @for record in audit {
            tr {
                td { (time(record.opened_at)) }
                td { @match record.closed_at { Some(at) => { (time(at)) } None => { "still open" } }
                     @if let Some(why) = &record.close_reason { br; small { (why) } } }
                td { small { (record.owner.as_str()) } }
                td { (record.session_name.as_str()) }
                td { (record.source.to_string()) " (" (record.institute.to_string()) ")" }
                td { (record.bytes_in) " / " (record.bytes_out) }
            }
        }
    };
    layout(
        "Site",
        Some(header),
        Some("admin"),
        html! {
            (live_region(live))
            section aria-labelledby="institutes" {
                h2 id="institutes" { "Institutes (who may reach the SSH gateway)" }
                (table("institute-list", html! { "Institutes (" (institutes.len()) ")" }, &["Name", "Networks", "Actions"],
                    institutes.is_empty().then_some("None: the gateway lets nobody in."), institute_rows))
                form method="post" action="/dashboard/admin/institutes" class="grid" {
                    (csrf_field(csrf))
                    label for="institute-name" { "Name" }
                    input id="institute-name" name="name" required placeholder="physics-lab";
                    label for="institute-networks" { "Networks (separated by spaces or commas)" }
                    input id="institute-networks" name="networks" required placeholder="192.0.2.0/24, 2001:db8::/32";
                    button type="submit" id="add-institute" { "Add institute" }
                }
            }
            section aria-labelledby="audit" {
                h2 id="audit" { "Audit log of SSH connections" }
                form method="get" action="/dashboard/admin#audit" class="grid" {
                    label for="audit-user" { "User DN" }
                    input id="audit-user" name="user" value=(filter.user) placeholder="/DC=org/DC=example/CN=Alice";
                    label for="audit-since" { "Since (time or duration ago)" }
                    input id="audit-since" name="since" value=(filter.since) placeholder="2 hours";
                    button type="submit" { "Filter" }
                }
                (table("audit-log", html! { "Connections, newest first (" (audit.len()) ")" },
                    &["Opened", "Closed", "User", "Session", "From", "Bytes in / out"],
                    audit.is_empty().then_some("No connections match."), audit_rows))
            }
        },
    )
}

/// A job's output (the last part of it, when long).
pub fn job_live(job: &JobRecord, output: &str, truncated: bool) -> Markup {
    let state = job.state();
    html! {
        p { "State: " span class={"state state-" (state.to_string().to_lowercase())} { (state.to_string()) }
            " — " (job.lifecycle.last().reason.to_string()) }
        @if truncated { p { "Only the last part of the output is shown." } }
        pre id="job-output" tabindex="0" aria-label="Job output" { (output) }
    }
}

pub fn job_page(header: &Header<'_>, job: &JobRecord, live: Markup) -> Markup {
    let id = job.id.to_string();
    layout(
        &format!("Job {id}"),
        Some(header),
        Some(&format!("job/{id}")),
        html! {
            p { a href="/dashboard/" { "Back to your sessions" } }
            (live_region(live))
        },
    )
}
