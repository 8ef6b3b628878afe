//! A real browser for the end-to-end tests: headless Chromium driven through chromedriver
//! (WebDriver, the fantoccini client), and the steps the browser tests share.
//!
//! [`Driver`] starts chromedriver itself (on a port it picks, `--port=0`) in its own process
//! group and kills that group, and any Chromium left with the test's profile directory, when it
//! is dropped, pass or fail.
//!
//! chromedriver and its Chromiums run in a network namespace of the test's own
//! ([`BrowserNetwork`]), holding only a loopback where the site's manager is relayed. Chromium
//! drops every request it has in flight (`ERR_NETWORK_CHANGED`) whenever the addresses of its
//! namespace change, and in the host's they change all the time while the tests run: each dev
//! container's veth, each test network's bridge. In its own namespace the browser sees none of
//! that, and it can reach nothing but the site.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use nix::sched::CloneFlags;
use ongrid_e2e::Site;
use serde_json::json;

/// chromedriver and the Chromiums it starts; all killed when dropped.
pub struct Driver {
    child: Child,
    /// Where chromedriver is reached from the host's namespace (relayed into the browsers').
    address: SocketAddr,
    /// The profile directories of the browsers, unique to this test.
    profiles: tempfile::TempDir,
    /// Dropped after chromedriver and its browsers are killed.
    _network: BrowserNetwork,
}

impl Driver {
    /// chromedriver in a network namespace of its own, where the browsers reach `site`'s
    /// manager (and its second replica, if started) at the same addresses as in the host's.
    pub fn start(site: &Site) -> Self {
        let mut network = BrowserNetwork::create();
        for manager in [&site.manager_addr, &site.manager2_addr]
            .into_iter()
            .flatten()
        {
            network.reach(manager.parse().expect("the manager's address"));
        }
        let profiles = tempfile::Builder::new()
            .prefix("ongrid-e2e-chromium-")
            .tempdir()
            .expect("profile directory");
        let mut child = inside(&network.namespace, || {
            Command::new("chromedriver")
                .arg("--port=0")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
        })
        .expect("chromedriver must be installed (Debian: chromium-driver)");
        let stdout = child.stdout.take().expect("chromedriver's stdout");
        let mut lines = BufReader::new(stdout).lines();
        let port = loop {
            let line = match lines.next() {
                Some(Ok(line)) => line,
                _ => {
                    let _ = child.kill();
                    panic!("chromedriver exited before saying its port");
                }
            };
            if let Some(rest) = line.split("started successfully on port ").nth(1) {
                break rest.trim_end_matches('.').trim().parse().expect("a port");
            }
        };
        // Keep reading, so chromedriver never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let address = network.expose(SocketAddr::from(([127, 0, 0, 1], port)));
        Self {
            child,
            address,
            profiles,
            _network: network,
        }
    }

    /// A new headless Chromium with its own profile (so its own cookies).
    pub async fn browser(&self, name: &str) -> Client {
        let profile = self.profiles.path().join(name);
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".to_owned(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--disable-gpu",
                    // The harness's throwaway CA is not in the browser's store.
                    "--ignore-certificate-errors",
                    "--window-size=1440,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://{}", self.address))
            .await
            .expect("a WebDriver session of chromedriver")
    }

    /// Processes whose command line names this test's profiles (Chromium and its helpers).
    pub fn browsers_left(&self) -> Vec<u32> {
        let marker = self.profiles.path().display().to_string();
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
                if String::from_utf8_lossy(&cmdline).contains(&marker) {
                    pids.push(pid);
                }
            }
        }
        pids
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in self.browsers_left() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// A network namespace of the test's own, with only a loopback, and the TCP relays between it
/// and the host's namespace (see the module's documentation).
///
/// A relay is a listening socket in one namespace whose connections are joined to a connection
/// made in the other: a socket stays in the namespace it was made in, whichever thread then
/// uses it, so only the making is done on a thread that entered the browsers' namespace.
struct BrowserNetwork {
    /// `/proc/thread-self/ns/net` of the thread that made the namespace; it lives while this is
    /// open or a process is in it.
    namespace: Arc<File>,
    /// Set when dropped: each relay's accept loop ends at its next connection.
    stopped: Arc<AtomicBool>,
    /// Each relay's listening address, and whether it listens in the browsers' namespace.
    listeners: Vec<(SocketAddr, bool)>,
}

impl BrowserNetwork {
    fn create() -> Self {
        let namespace = std::thread::spawn(|| -> std::io::Result<File> {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
            let namespace = File::open("/proc/thread-self/ns/net")?;
            // A process started from this thread is in its namespace.
            let up = Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()?;
            if !up.success() {
                return Err(std::io::Error::other(format!("ip link set lo up: {up}")));
            }
            Ok(namespace)
        })
        .join()
        .expect("the thread making the browsers' network namespace")
        .expect("a network namespace for the browsers (the browser tests need root and iproute2)");
        Self {
            namespace: Arc::new(namespace),
            stopped: Arc::new(AtomicBool::new(false)),
            listeners: Vec::new(),
        }
    }

    /// The browsers reach `address` of the host's namespace at the same address in theirs.
    fn reach(&mut self, address: SocketAddr) {
        let listener = inside(&self.namespace, || TcpListener::bind(address))
            .unwrap_or_else(|e| panic!("listen on {address} in the browsers' namespace: {e}"));
        self.listeners.push((address, true));
        relay(listener, self.stopped.clone(), move || {
            TcpStream::connect(address)
        });
    }

    /// An address of the host's namespace that reaches `address` of the browsers'.
    fn expose(&mut self, address: SocketAddr) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a relay's port");
        let exposed = listener.local_addr().expect("the relay's address");
        self.listeners.push((exposed, false));
        let namespace = self.namespace.clone();
        relay(listener, self.stopped.clone(), move || {
            inside(&namespace, || TcpStream::connect(address))
        });
        exposed
    }
}

impl Drop for BrowserNetwork {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        // Each accept loop wakes on one more connection, sees the flag and ends, closing its
        // listener.
        for &(address, in_browsers) in &self.listeners {
            let _ = if in_browsers {
                inside(&self.namespace, || TcpStream::connect(address))
            } else {
                TcpStream::connect(address)
            };
        }
    }
}

/// Runs `make` on a thread that entered `namespace`: the sockets and processes it makes are in
/// that namespace.
fn inside<T: Send>(namespace: &File, make: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                nix::sched::setns(namespace, CloneFlags::CLONE_NEWNET)
                    .expect("enter the browsers' network namespace");
                make()
            })
            .join()
            .expect("a thread in the browsers' network namespace")
    })
}

/// Joins each connection to `listener` to one `connect` makes, until `stopped`.
fn relay(
    listener: TcpListener,
    stopped: Arc<AtomicBool>,
    connect: impl Fn() -> std::io::Result<TcpStream> + Send + 'static,
) {
    std::thread::spawn(move || {
        for accepted in listener.incoming() {
            if stopped.load(Ordering::SeqCst) {
                return;
            }
            let Ok(accepted) = accepted else { continue };
            // Refused there: closing this side tells the client so.
            let Ok(onward) = connect() else { continue };
            join(accepted, onward);
        }
    });
}

/// Copies each way between `a` and `b` until each side has said all; an end of one direction
/// is passed on as that (a half-close), so neither side waits on the relay.
fn join(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    for (from, to) in [(a, b), (b2, a2)] {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut &from, &mut &to);
            let _ = to.shutdown(Shutdown::Write);
        });
    }
}

/// Waits until `css` matches an element (the page's live updates bring it).
pub async fn wait_for(client: &Client, css: &str, within: Duration) {
    wait_or(client, css, within, String::new).await
}

/// [`wait_for`], with `diagnose` saying what else to show when it does not come.
pub async fn wait_or(
    client: &Client,
    css: &str,
    within: Duration,
    diagnose: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + within;
    loop {
        let found = client.find_all(Locator::Css(css)).await.unwrap_or_default();
        if !found.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let page = client.source().await.unwrap_or_default();
            panic!(
                "{css} did not appear within {within:?}; the page:\n{page}\n{}",
                diagnose()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Opens a login link and presses its button; then waits for `then` (the page the link leads
/// to).
pub async fn log_in(client: &Client, link: &str, then: &str) {
    client.goto(link).await.expect("open the login link");
    wait_for(client, "#log-in", Duration::from_secs(30)).await;
    client
        .find(Locator::Css("#log-in"))
        .await
        .expect("the login button")
        .click()
        .await
        .expect("log in");
    wait_for(client, then, Duration::from_secs(60)).await;
}

pub async fn fill(client: &Client, css: &str, text: &str) {
    let input = client.find(Locator::Css(css)).await.expect(css);
    input.clear().await.expect("clear");
    input.send_keys(text).await.expect("type");
}

/// Clicks `css`, looking again if a live update replaced the element meanwhile.
pub async fn click(client: &Client, css: &str) {
    for _ in 0..5 {
        let element = client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        match element.click().await {
            Ok(()) => return,
            Err(e) if e.to_string().contains("stale element") => continue,
            Err(e) => panic!("click {css}: {e}"),
        }
    }
    panic!("{css} kept being replaced");
}

/// The text of the element `css` matches, read in one script (a live update may replace it
/// between two WebDriver calls).
pub async fn text_of(client: &Client, css: &str) -> String {
    let script = format!(
        "const e = document.querySelector({}); return e ? e.innerText : null;",
        json!(css)
    );
    let text = client
        .execute(&script, Vec::new())
        .await
        .expect("read the page");
    text.as_str()
        .unwrap_or_else(|| panic!("no {css}"))
        .to_owned()
}

pub async fn screenshot(client: &Client, dir: &Path, name: &str) {
    let png = client.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::create_dir_all(dir).expect("screenshot directory");
    std::fs::write(dir.join(name), png).expect("write screenshot");
}
