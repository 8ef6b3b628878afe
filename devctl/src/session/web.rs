//! `devctl session web NAME [--port P]`: a running session's web app in the browser, JupyterLab
//! or a web server the user started on a port. The manager's dashboard relays both, behind its
//! login (`/dashboard/sessions/NAME/apps/jupyter/`, `/dashboard/sessions/NAME/apps/port/P/`), so
//! this checks that the session runs (`GET /v1/sessions/{name}`), asks for a dashboard login
//! link that leads there ([`crate::dashboard::login_link`]), prints it, and opens it where a
//! browser exists.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use chrono::Utc;
use clap::Args;
use ongrid_core::api::SessionView;
use ongrid_core::{SessionName, SessionState};

use super::view::{self, describe_state};
use crate::client::Client;
use crate::config::Env;
use crate::dashboard::{self, LoginLink};
use crate::terminal::Terminal;

/// How long a browser command may take to hand the link over before devctl leaves it running
/// and exits (`xdg-open` returns at once; a browser started by `$BROWSER` may run on).
const OPEN_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Args)]
pub struct WebArgs {
    /// The session's name
    pub name: SessionName,
    /// A web server you started in the session on this port (like 8080), instead of JupyterLab
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub port: Option<u16>,
    /// Only print the link; do not open a browser
    #[arg(long)]
    pub no_open: bool,
}

/// `devctl session web`
pub async fn run(args: WebArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let session = view::fetch(client, &args.name, None).await?;
    if let Some(refusal) = not_running(&session) {
        anyhow::bail!(refusal);
    }
    let app = App::new(&args.name, args.port);
    let link = dashboard::login_link(client, Some(&app.path())).await?;
    term.print(&format!("{}\n", link.url))?;
    term.note(&render_note(
        &app,
        &link,
        &client.context().manager_url,
        Utc::now(),
    ));
    if !args.no_open {
        if let Some(opener) = Opener::choose(&Env::from_process()) {
            if let Err(problem) = opener.open(&link.url).await {
                term.note(&format!(
                    "warning: could not open a browser ({problem}): open the link above yourself"
                ));
            }
        }
    }
    Ok(())
}

/// Why a session in its state serves no web app, with what to do; `None` while it runs.
pub fn not_running(session: &SessionView) -> Option<String> {
    let name = &session.name;
    let reason = &session.reason;
    match session.state {
        SessionState::Waiting | SessionState::Connected | SessionState::Idle => None,
        SessionState::Pending | SessionState::Starting => Some(format!(
            "session {name} is {}, not running yet: try again once it is WAITING (see `devctl \
             session show {name}`; next time, `devctl session new --wait` waits for that)",
            describe_state(session)
        )),
        SessionState::Held => Some(format!(
            "session {name} is HELD ({reason}): run `devctl session release {name}` first"
        )),
        SessionState::Failed => Some(format!(
            "session {name} FAILED ({reason}) and runs no more: remove it with `devctl session \
             rm {name}` and ask for a new one with `devctl session new`"
        )),
        SessionState::Ended => Some(format!(
            "session {name} was removed ({reason}): ask for a new one with `devctl session new`"
        )),
    }
}

/// The web app asked for: JupyterLab, or a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct App<'a> {
    session: &'a SessionName,
    port: Option<u16>,
}

impl<'a> App<'a> {
    pub fn new(session: &'a SessionName, port: Option<u16>) -> Self {
        Self { session, port }
    }

    /// Its page on the dashboard: `/dashboard/sessions/train1/apps/jupyter/` or
    /// `/dashboard/sessions/train1/apps/port/8080/` (session names need no percent-encoding).
    pub fn path(&self) -> String {
        match self.port {
            Some(port) => format!("/dashboard/sessions/{}/apps/port/{port}/", self.session),
            None => format!("/dashboard/sessions/{}/apps/jupyter/", self.session),
        }
    }

    /// In words: `JupyterLab of session train1`, `port 8080 of session train1`.
    fn describe(&self) -> String {
        match self.port {
            Some(port) => format!("port {port} of session {}", self.session),
            None => format!("JupyterLab of session {}", self.session),
        }
    }
}

/// The note on stderr under the printed link, as of `now`.
pub fn render_note(
    app: &App<'_>,
    link: &LoginLink,
    manager_url: &str,
    now: chrono::DateTime<Utc>,
) -> String {
    format!(
        "This link logs a browser in and opens {} ({}); a browser logged in to the dashboard \
         already can open {manager_url}{} directly.",
        app.describe(),
        dashboard::works_once(link.expires_at, now),
        app.path()
    )
}

/// How the link is opened, if at all: `$BROWSER` when set, else `xdg-open` when there is a
/// graphical display and it is on `PATH`.
///
/// Written here rather than taken from the `webbrowser` crate: without a display that crate
/// falls back to text browsers (lynx, w3m, ...) in the terminal, which would take over the
/// terminal of an ssh login; here the link is only printed then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opener {
    /// The program `$BROWSER` names, run with the URL as its one argument (no shell).
    Browser(String),
    /// `xdg-open`, found on `PATH`.
    XdgOpen(PathBuf),
}

impl Opener {
    pub fn choose(env: &Env) -> Option<Self> {
        if let Some(browser) = env.get("BROWSER") {
            return Some(Self::Browser(browser.to_owned()));
        }
        if env.get("DISPLAY").is_none() && env.get("WAYLAND_DISPLAY").is_none() {
            return None;
        }
        std::env::split_paths(env.get("PATH")?)
            .map(|dir| dir.join("xdg-open"))
            .find(|file| file.is_file())
            .map(Self::XdgOpen)
    }

    fn program(&self) -> &Path {
        match self {
            Self::Browser(program) => Path::new(program),
            Self::XdgOpen(path) => path,
        }
    }

    /// Runs the program with `url` and waits for it for [`OPEN_WAIT`]; one still running then
    /// is left to run (a browser that stays open). It gets no terminal: its input and output
    /// go nowhere, so it never draws over the shell or into a pipe of devctl's output. The
    /// error says what failed.
    pub async fn open(&self, url: &str) -> Result<(), String> {
        let name = match self {
            Self::Browser(program) => format!("$BROWSER {program}"),
            Self::XdgOpen(path) => path.display().to_string(),
        };
        let mut child = tokio::process::Command::new(self.program())
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|err| format!("{name}: {err}"))?;
        match tokio::time::timeout(OPEN_WAIT, child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!("{name} {status}")),
            Ok(Err(err)) => Err(format!("{name}: {err}")),
            Err(_still_running) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::fixtures::session;

    #[test]
    fn the_app_is_jupyterlab_or_a_port() {
        let name = SessionName::parse("train1").unwrap();
        assert_eq!(
            App::new(&name, None).path(),
            "/dashboard/sessions/train1/apps/jupyter/"
        );
        assert_eq!(
            App::new(&name, Some(8080)).path(),
            "/dashboard/sessions/train1/apps/port/8080/"
        );
    }

    #[test]
    fn only_a_running_session_serves_web_apps() {
        for state in [
            SessionState::Waiting,
            SessionState::Connected,
            SessionState::Idle,
        ] {
            assert_eq!(not_running(&session("train1", state)), None, "{state}");
        }
        let held = SessionView {
            reason: "idle for 2h".into(),
            ..session("train1", SessionState::Held)
        };
        assert_eq!(
            not_running(&held).unwrap(),
            "session train1 is HELD (idle for 2h): run `devctl session release train1` first"
        );
        let pending = not_running(&session("train1", SessionState::Pending)).unwrap();
        assert!(pending.contains("not running yet"), "{pending}");
        assert!(pending.contains("devctl session new --wait"), "{pending}");
        let failed = not_running(&session("train1", SessionState::Failed)).unwrap();
        assert!(failed.contains("devctl session rm train1"), "{failed}");
        let ended = not_running(&session("train1", SessionState::Ended)).unwrap();
        assert!(ended.contains("devctl session new"), "{ended}");
    }

    #[test]
    fn the_note_says_how_long_the_link_works_and_where_the_app_is() {
        let name = SessionName::parse("train1").unwrap();
        let now = chrono::DateTime::from_timestamp(1_795_255_200, 0).unwrap();
        let link = LoginLink {
            url: "https://manager:8443/dashboard/login?token=abc".into(),
            expires_at: now + chrono::TimeDelta::minutes(5),
        };
        let note = render_note(
            &App::new(&name, Some(8080)),
            &link,
            "https://manager:8443",
            now,
        );
        assert_eq!(
            note,
            "This link logs a browser in and opens port 8080 of session train1 (it works once, \
             for 5m 0s, until 2026-11-21 10:05:00Z); a browser logged in to the dashboard \
             already can open https://manager:8443/dashboard/sessions/train1/apps/port/8080/ \
             directly."
        );
    }

    #[test]
    fn a_browser_is_browser_or_xdg_open_with_a_display() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("xdg-open"), "#!/bin/sh\n").unwrap();
        let path = dir.path().display().to_string();
        let env = |vars: &[(&str, &str)]| vars.iter().copied().collect::<Env>();
        assert_eq!(
            Opener::choose(&env(&[("BROWSER", "firefox"), ("PATH", &path)])),
            Some(Opener::Browser("firefox".into()))
        );
        assert_eq!(
            Opener::choose(&env(&[("DISPLAY", ":0"), ("PATH", &path)])),
            Some(Opener::XdgOpen(dir.path().join("xdg-open")))
        );
        assert_eq!(
            Opener::choose(&env(&[("WAYLAND_DISPLAY", "wayland-0"), ("PATH", &path)])),
            Some(Opener::XdgOpen(dir.path().join("xdg-open")))
        );
        // No display (an ssh login): nothing, whatever is installed.
        assert_eq!(Opener::choose(&env(&[("PATH", &path)])), None);
        // A display but no xdg-open.
        assert_eq!(
            Opener::choose(&env(&[("DISPLAY", ":0"), ("PATH", "/nonexistent")])),
            None
        );
        // An empty BROWSER is no browser.
        assert_eq!(
            Opener::choose(&env(&[("BROWSER", ""), ("PATH", &path)])),
            None
        );
    }

    #[tokio::test]
    async fn a_failing_browser_is_reported() {
        let err = Opener::Browser("/nonexistent/browser".into())
            .open("https://x")
            .await
            .unwrap_err();
        assert!(err.starts_with("$BROWSER /nonexistent/browser: "), "{err}");
        let err = Opener::Browser("false".into())
            .open("https://x")
            .await
            .unwrap_err();
        assert!(err.contains("exit status: 1"), "{err}");
        Opener::Browser("true".into())
            .open("https://x")
            .await
            .unwrap();
    }
}
