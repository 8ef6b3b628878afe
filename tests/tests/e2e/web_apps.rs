//! A session's web apps in a real browser (headless Chromium, `super::browser`): the link
//! `devctl session web` prints logs the owner in and opens JupyterLab of the session, started
//! on demand inside it; a notebook cell runs there and prints what the session's own shell
//! sees; a web server on a port of the session opens too, and a port nothing listens on says
//! so; another user's browser reaches none of it; once the session is held, its pages say how
//! to release it and a WebSocket to it is closed with that message.
//!
//! A screenshot of JupyterLab goes to the test's directory, or to
//! `$ONGRID_DASHBOARD_SCREENSHOTS` when set (README's comes from there).

use std::path::PathBuf;
use std::time::Duration;

use fantoccini::{Client, Locator};
use ongrid_e2e::{SimGpu, Site, User};
use serde_json::json;

use super::browser::{log_in, screenshot, text_of, wait_for, Driver};

/// Runs `command` in the session through the gateway, until the gateway lets the user in.
fn in_session(site: &Site, user: &User, session: &str, command: &str, stdin: &[u8]) -> String {
    let out = site.wait_until("ssh into the session", Duration::from_secs(30), || {
        let out = site.ssh(user, session, command, stdin);
        out.status.success().then_some(out)
    });
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The first `https://` line of devctl's output.
fn link_in(out: &str) -> String {
    out.lines()
        .map(str::trim)
        .find(|line| line.starts_with("https://"))
        .unwrap_or_else(|| panic!("no link in: {out}"))
        .to_owned()
}

/// `https://host:port` of a link.
fn origin_of(link: &str) -> String {
    let at = link.find("/dashboard/").expect("a dashboard link");
    link[..at].to_owned()
}

/// The page's whole text.
async fn page_text(client: &Client) -> String {
    client
        .execute(
            "return document.body ? document.body.innerText : '';",
            vec![],
        )
        .await
        .expect("read the page")
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Opens `url` and waits until the page's text holds `expected`.
async fn open_until(client: &Client, url: &str, expected: &str) -> String {
    client.goto(url).await.expect("open the page");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = page_text(client).await;
        if text.contains(expected) {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{url} did not show {expected:?}; it shows:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `script` returns true in the page.
async fn wait_true(client: &Client, script: &str, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let ready = client
            .execute(script, vec![])
            .await
            .ok()
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if ready {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the page did not get ready within {within:?}: {script}\n{}",
            page_text(client).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Opens a WebSocket from the page and answers how it closed: `[code, reason]`.
async fn websocket_close(client: &Client, url: &str) -> (u64, String) {
    let script = "const [url, done] = arguments; const ws = new WebSocket(url); \
                  ws.onclose = (e) => done([e.code, e.reason]);";
    let answer = client
        .execute_async(script, vec![json!(url)])
        .await
        .expect("a WebSocket's close");
    (
        answer[0].as_u64().unwrap_or_default(),
        answer[1].as_str().unwrap_or_default().to_owned(),
    )
}

/// The one-cell notebook the test runs: what the kernel's environment says of the GPUs and
/// the user.
fn notebook() -> String {
    json!({
        "cells": [{
            "cell_type": "code",
            "execution_count": null,
            "id": "check",
            "metadata": {},
            "outputs": [],
            "source": ["import getpass, os\n",
                       "print('GPUS=' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), 'USER=' + getpass.getuser())"]
        }],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
        },
        "nbformat": 4,
        "nbformat_minor": 5
    })
    .to_string()
}

#[test]
fn jupyterlab_of_a_session_opens_in_its_owners_browser_and_nowhere_else() {
    // Warned from the start: the page's hold warning shows within its first check.
    let mut site = Site::start_with_lifecycle(&[SimGpu::a100(1)], "warn_before = \"3 hours\"");
    site.allow_loopback();
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "nb", "--wait"]);
    let shots: PathBuf = std::env::var_os("ONGRID_DASHBOARD_SCREENSHOTS")
        .map_or_else(|| site.dir.path().join("screenshots"), PathBuf::from);

    // What the session's own shell sees, which the notebook must see too.
    let seen = in_session(
        &site,
        &alice,
        "nb",
        "echo \"GPUS=${CUDA_VISIBLE_DEVICES:-unset} USER=$(whoami)\"",
        b"",
    );
    let seen = seen.trim().to_owned();
    assert!(
        seen.contains(&format!("USER={}", site.login_of("Alice"))) && !seen.contains("unset"),
        "{seen}"
    );
    in_session(
        &site,
        &alice,
        "nb",
        "cat > check.ipynb",
        notebook().as_bytes(),
    );
    // A web server of the user's own on a port of the session.
    in_session(
        &site,
        &alice,
        "nb",
        "mkdir -p www && echo hello-from-port-8000 > www/index.html && \
         (cd www && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &); \
         for i in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && break; sleep 0.1; done",
        b"",
    );

    let out = site.devctl_ok(&alice, &["session", "web", "nb", "--no-open"]);
    eprintln!("$ devctl session web nb --no-open\n{out}");
    let link = link_in(&out);
    let origin = origin_of(&link);
    let jupyter = format!("{origin}/dashboard/sessions/nb/apps/jupyter/");
    // A WebSocket of JupyterLab's, for the refusals' closes.
    let events = format!("wss://{}api/events/subscribe", &jupyter["https://".len()..]);
    let bob_link = link_in(&site.devctl_ok(&bob, &["dashboard"]));

    let driver = Driver::start(&site);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let browser = driver.browser("alice").await;
        // The link logs in and leads to JupyterLab, started inside the session on demand.
        log_in(&browser, &link, "#jp-main-dock-panel").await;
        let url = browser.current_url().await.expect("the page's URL");
        assert!(
            url.as_str().starts_with(&jupyter),
            "the link leads to JupyterLab: {url}"
        );
        let source = browser.source().await.expect("the page");
        assert!(
            !source.contains("token="),
            "JupyterLab's token never reaches the browser"
        );
        // The hold warning an SSH terminal gets shows above JupyterLab.
        wait_for(
            &browser,
            "#ongrid-session-warning:not([hidden])",
            Duration::from_secs(30),
        )
        .await;
        let warning = text_of(&browser, "#ongrid-session-warning span").await;
        assert!(
            warning.contains("Session nb will be put on hold in 1 h")
                && warning.contains("devctl session keep nb"),
            "{warning}"
        );

        // A cell runs in the session, as its user, on its GPUs.
        browser
            .goto(&format!("{jupyter}lab/tree/check.ipynb"))
            .await
            .expect("open the notebook");
        // The notebook shows once its kernel started; the status bar says when it is idle.
        wait_true(
            &browser,
            "const e = document.querySelector('.jp-Notebook .jp-Cell .cm-content'); \
             const bar = document.querySelector('.jp-StatusBar-Widget, #jp-main-statusbar'); \
             return !!(e && e.checkVisibility() && bar && bar.innerText.includes('Idle'));",
            Duration::from_secs(120),
        )
        .await;
        let editor = browser
            .find(Locator::Css(".jp-Notebook .jp-Cell .cm-content"))
            .await
            .expect("the cell's editor");
        editor.click().await.expect("into the cell");
        // Shift+Enter: run the cell (WebDriver's Shift, Enter, then release the modifiers).
        editor
            .send_keys("\u{E008}\u{E007}\u{E000}")
            .await
            .expect("run the cell");
        wait_for(&browser, ".jp-OutputArea-output", Duration::from_secs(120)).await;
        let output = text_of(&browser, ".jp-OutputArea-output").await;
        assert_eq!(
            output.trim(),
            seen,
            "the notebook sees what the session's shell sees"
        );
        screenshot(&browser, &shots, "jupyterlab.png").await;
        // The notebook's kernel connection is the browser's connection to the session, as an
        // SSH connection would be: the session is CONNECTED, and the audit log says from where.
        site.wait_for_state(&alice, "nb", "CONNECTED");
        let audit = site.devctl_ok(&site.admin, &["admin", "audit"]);
        assert!(
            audit
                .lines()
                .any(|line| line.contains("nb") && line.contains("browser")),
            "the audit log records the browser's connection:\n{audit}"
        );

        // The session's other web servers, and what a port nothing listens on says.
        open_until(
            &browser,
            &format!("{origin}/dashboard/sessions/nb/apps/port/8000/"),
            "hello-from-port-8000",
        )
        .await;
        open_until(
            &browser,
            &format!("{origin}/dashboard/sessions/nb/apps/port/9/"),
            "nothing answers on port 9 of session nb",
        )
        .await;
        let apps = open_until(
            &browser,
            &format!("{origin}/dashboard/sessions/nb/apps/"),
            "Open JupyterLab",
        )
        .await;
        assert!(
            apps.contains("8000"),
            "the page lists the open port:\n{apps}"
        );

        // Another user's browser reaches nothing of it, by any of its paths.
        let bobs = driver.browser("bob").await;
        log_in(&bobs, &bob_link, "#start-session").await;
        for path in ["apps/jupyter/lab", "apps/port/8000/", "apps/"] {
            let text = open_until(
                &bobs,
                &format!("{origin}/dashboard/sessions/nb/{path}"),
                "you have no session named nb",
            )
            .await;
            assert!(!text.contains("hello-from-port"), "{text}");
        }
        let (code, reason) = websocket_close(&bobs, &events).await;
        assert!(
            code == 1008 && reason.contains("no session named nb"),
            "{code} {reason}"
        );

        // Held: the pages say how to release it; a WebSocket is closed with that message.
        site.devctl_ok(&alice, &["session", "hold", "nb"]);
        site.wait_for_state(&alice, "nb", "HELD");
        let text = open_until(&browser, &jupyter, "is HELD").await;
        assert!(text.contains("devctl session release nb"), "{text}");
        let (code, reason) = websocket_close(&browser, &events).await;
        assert!(code == 1008 && reason.contains("HELD"), "{code} {reason}");
        assert!(reason.contains("release"), "{reason}");

        browser.close().await.expect("close the browser");
        bobs.close().await.expect("close Bob's browser");
    });
}

/// A web server for the streaming test: `GET /<n>` answers n zero bytes, `PUT` reads the whole
/// body and answers how many bytes came; both in 64 KiB pieces, never whole.
const STREAM_SERVER: &str = r#"
import http.server
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        left = int(self.path.strip("/") or 0)
        self.send_response(200)
        self.send_header("Content-Length", str(left))
        self.end_headers()
        piece = bytes(65536)
        while left > 0:
            self.wfile.write(piece[: min(left, len(piece))])
            left -= len(piece)
    def do_PUT(self):
        left, got = int(self.headers["Content-Length"]), 0
        while got < left:
            data = self.rfile.read(min(65536, left - got))
            if not data:
                break
            got += len(data)
        body = str(got).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8001), Handler).serve_forever()
"#;

/// A WebSocket server for the flood: on `/flood`, 1 MiB binary messages, each sent as soon as
/// the previous one was handed to the socket (tornado, from the image's JupyterLab venv).
const FLOOD_SERVER: &str = r#"
import asyncio
import tornado.web, tornado.websocket
class Flood(tornado.websocket.WebSocketHandler):
    async def open(self):
        piece = bytes(1 << 20)
        try:
            while True:
                await self.write_message(piece, binary=True)
        except tornado.websocket.WebSocketClosedError:
            pass
async def main():
    tornado.web.Application([(r"/flood", Flood)]).listen(8002, "127.0.0.1")
    await asyncio.Event().wait()
asyncio.run(main())
"#;

/// Reads one message of the flood through the manager, reads nothing for five seconds, then
/// reads on: how many messages came after the pause (they must keep coming).
async fn flood(site: &Site, origin: &str, cookie: &str) -> usize {
    use futures::StreamExt;
    use rustls::pki_types::pem::PemObject;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::http::HeaderValue;

    let authority = origin.trim_start_matches("https://").to_owned();
    let ca = rustls::pki_types::CertificateDer::from_pem_file(site.pki.ca_dir.join("0e2e0e2e.0"))
        .expect("the site's CA");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("a usable CA");
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let addr: std::net::SocketAddr = authority.parse().expect("the manager's address");
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(
            rustls::pki_types::ServerName::IpAddress(addr.ip().into()),
            tcp,
        )
        .await
        .expect("TLS to the manager");
    let mut request = format!("wss://{authority}/dashboard/sessions/big/apps/port/8002/flood")
        .into_client_request()
        .expect("a request");
    let headers = request.headers_mut();
    headers.insert(
        "cookie",
        HeaderValue::from_str(&format!("ongrid_dashboard={cookie}")).expect("a cookie"),
    );
    headers.insert("origin", HeaderValue::from_str(origin).expect("an origin"));
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(2 << 20));
    let (mut socket, _) = tokio_tungstenite::client_async_with_config(request, tls, Some(config))
        .await
        .expect("the WebSocket through the manager");
    let first = socket.next().await.expect("a message").expect("a message");
    assert_eq!(first.len(), 1 << 20, "a whole 1 MiB message");
    let (_, peak_before) = manager_memory(site);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, peak_after) = manager_memory(site);
    eprintln!("a flooding WebSocket not read for 5 s:");
    assert_grew_less_than(
        48,
        peak_before,
        peak_after,
        "the manager kept what the reader did not take",
    );
    let mut after = 0;
    while after < 20 {
        match tokio::time::timeout(Duration::from_secs(10), socket.next()).await {
            Ok(Some(Ok(message))) if message.len() == 1 << 20 => after += 1,
            other => panic!("the flood stopped after the pause: {other:?}"),
        }
    }
    after
}

/// Prints the manager's memory before and after (KiB), and fails with `what` when it grew by
/// `limit_mib` or more.
fn assert_grew_less_than(limit_mib: u64, before: u64, after: u64, what: &str) {
    let (before, after) = (before / 1024, after / 1024);
    eprintln!("the manager's memory {before} MiB before, {after} MiB at its peak");
    assert!(
        after < before + limit_mib,
        "{what}: {before} MiB before, {after} MiB at its peak"
    );
}

/// The manager's resident memory now and at its peak, in KiB.
fn manager_memory(site: &Site) -> (u64, u64) {
    let pid = site.pid("manager").expect("the manager runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{name} in {status}"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[test]
fn large_transfers_and_a_flooding_websocket_go_through_without_filling_the_managers_memory() {
    const SIZE: u64 = 256 * 1024 * 1024;
    let mut site = Site::start(&[SimGpu::a100(1)]);
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "big", "--wait"]);
    in_session(
        &site,
        &alice,
        "big",
        "cat > serve.py",
        STREAM_SERVER.as_bytes(),
    );
    in_session(
        &site,
        &alice,
        "big",
        "cat > flood.py",
        FLOOD_SERVER.as_bytes(),
    );
    in_session(
        &site,
        &alice,
        "big",
        "(nohup python3 serve.py >/dev/null 2>&1 &); \
         (nohup /opt/ongrid/jupyter/bin/python flood.py >/dev/null 2>&1 &); \
         for port in 8001 8002; do for i in $(seq 100); do \
         (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done; done",
        b"",
    );

    // A browser's login, as curl keeps it: the link's page, then its button's POST.
    let link = link_in(&site.devctl_ok(&alice, &["dashboard"]));
    let origin = origin_of(&link);
    let token = link.split("token=").nth(1).expect("the link's token");
    let ca = site.pki.ca_dir.join("0e2e0e2e.0");
    let jar = site.dir.path().join("cookies");
    let curl = |args: &[&str]| {
        let out = std::process::Command::new("curl")
            .args(["-sS", "--fail-with-body", "--cacert"])
            .arg(&ca)
            .arg("-b")
            .arg(&jar)
            .arg("-c")
            .arg(&jar)
            .args(args)
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "curl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    curl(&[
        "-o",
        "/dev/null",
        "-d",
        &format!("token={token}"),
        &format!("{origin}/dashboard/login"),
    ]);
    let port = format!("{origin}/dashboard/sessions/big/apps/port/8001");

    let (before, _) = manager_memory(&site);
    let started = std::time::Instant::now();
    let got = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{size_download}",
        &format!("{port}/{SIZE}"),
    ]);
    let download = started.elapsed();
    assert_eq!(got.trim(), SIZE.to_string(), "the whole download arrives");

    let upload_file = site.dir.path().join("upload.bin");
    std::fs::File::create(&upload_file)
        .and_then(|file| file.set_len(SIZE))
        .expect("a sparse file to upload");
    let started = std::time::Instant::now();
    let got = curl(&[
        "-T",
        upload_file.to_str().expect("a path"),
        &format!("{port}/upload"),
    ]);
    let upload = started.elapsed();
    assert_eq!(
        got.trim(),
        SIZE.to_string(),
        "the session's server got the whole upload"
    );

    // A WebSocket whose server sends 1 MiB messages as fast as it may, to a reader that stops
    // reading for a while: the relay waits for the reader instead of keeping the flood.
    let cookie = std::fs::read_to_string(&jar)
        .expect("the cookie jar")
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            (fields.len() == 7 && fields[5] == "ongrid_dashboard").then(|| fields[6].to_owned())
        })
        .expect("the login cookie in the jar");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let flooded = runtime.block_on(flood(&site, &origin, &cookie));
    assert!(
        flooded >= 20,
        "the flood went on after the pause: {flooded} messages"
    );

    let (_, peak) = manager_memory(&site);
    eprintln!("256 MiB down in {download:?}, up in {upload:?}:");
    assert_grew_less_than(128, before, peak, "the manager buffered what it relays");
}
