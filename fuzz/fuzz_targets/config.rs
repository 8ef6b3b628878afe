//! Fuzzes every TOML file ongrid reads, each through its real loader and validation: the
//! gateway's, the agent's (and its simulated-GPU file), the manager's, devctl's, and batch job
//! files (`JobSpecFile`). Each input is tried as all of them (`deny_unknown_fields` sends most
//! inputs out early), so the seeds are plain files.
//!
//! The files a config names are real: `@FIXTURE@` in the input stands for a directory this
//! harness fills once (a CA directory, token files, a TLS key pair, the simulated GPUs, a host
//! key directory), so mutations of the seeds get past the file checks into the validation
//! after them. An input naming a special file (under /dev, /proc or /sys, a FIFO, a file over
//! 1 MiB) is skipped: configs are written by the site's admin, and /dev/zero as a token file is
//! not a parser bug.
//!
//! Properties: no loader panics, every refusal renders, and an accepted config's `Debug` (what
//! could reach a log) never shows a token.
#![no_main]

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use chrono::{TimeZone, Utc};
use libfuzzer_sys::fuzz_target;

const PLACEHOLDER: &str = "@FIXTURE@";
const TOKEN: &str = "fuzz-token-5f3a9c1e7b2d4068";

struct Fixture {
    dir: PathBuf,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ongrid-fuzz-config-{}", std::process::id()));
        let write = |name: &str, text: &str| {
            std::fs::write(dir.join(name), text).expect("writing the fixture");
        };
        std::fs::create_dir_all(dir.join("certificates")).expect("fixture ca dir");
        std::fs::create_dir_all(dir.join("gateway")).expect("fixture host key dir");
        std::fs::create_dir_all(dir.join("images")).expect("fixture image store");
        let cert = rcgen::generate_simple_self_signed(vec!["node1.example.org".to_owned()])
            .expect("fixture certificate");
        write("certificates/ca.0", &cert.cert.pem());
        write("agent.crt", &cert.cert.pem());
        write("agent.key", &cert.key_pair.serialize_pem());
        for token in ["gateway-token", "node-token"] {
            write(token, &format!("{TOKEN}\n"));
        }
        write("agent-tokens", &format!("node1 {TOKEN}\n"));
        write(
            "simulated-gpus.toml",
            include_str!("../../deploy/examples/simulated-gpus.toml"),
        );
        Fixture { dir }
    })
}

/// Whether a string of the config, taken as a path (as is, or relative to the fixture, where
/// devctl anchors relative paths), names something a loader must not be pointed at.
fn special(value: &str, base: &Path) -> bool {
    [Path::new(value).to_path_buf(), base.join(value)]
        .iter()
        .any(|path| match std::fs::canonicalize(path) {
            Err(_) => false,
            Ok(real) => {
                ["/dev", "/proc", "/sys"]
                    .iter()
                    .any(|p| real.starts_with(p))
                    || match std::fs::metadata(&real) {
                        Ok(meta) => !(meta.is_dir() || meta.is_file()) || meta.len() > 1 << 20,
                        Err(_) => true,
                    }
            }
        })
}

fn names_special_files(value: &toml::Value, base: &Path) -> bool {
    match value {
        toml::Value::String(s) => special(s, base),
        toml::Value::Array(items) => items.iter().any(|v| names_special_files(v, base)),
        toml::Value::Table(table) => table.values().any(|v| names_special_files(v, base)),
        _ => false,
    }
}

/// Renders an error and its causes, as the binaries print them.
fn render(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

fn accepted<T: std::fmt::Debug, E: Error>(what: &str, result: Result<T, E>) {
    match result {
        Ok(config) => {
            let debug = format!("{config:?}");
            assert!(
                !debug.contains(TOKEN),
                "{what}: a token reaches Debug: {debug}"
            );
        }
        Err(error) => {
            let _ = render(&error);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let fixture = fixture();
    let text = text.replace(PLACEHOLDER, &fixture.dir.to_string_lossy());
    if let Ok(value) = text.parse::<toml::Table>() {
        if names_special_files(&toml::Value::Table(value), &fixture.dir) {
            return;
        }
    }
    let path = Path::new("fuzz.toml");

    accepted("gateway", ongrid_gateway::Config::parse(&text, path));
    accepted("agent", ongrid_agent::config::Config::parse(&text, path));
    accepted(
        "simulated GPUs",
        ongrid_agent::gpu::simulated::parse(&text, path),
    );
    accepted(
        "manager",
        ongrid_manager::Config::from_toml(&text, path, |_| None),
    );

    let now = Utc
        .with_ymd_and_hms(2026, 5, 1, 9, 0, 0)
        .single()
        .expect("fixed time");
    match ongrid_core::job::JobSpecFile::from_toml(&text) {
        Ok(file) => accepted("job file", file.validate(now)),
        Err(error) => {
            let _ = render(&error);
        }
    }

    let devctl_file = fixture.dir.join("devctl.toml");
    match devctl::config::parse_file(&devctl_file, &text) {
        Ok(_) => {
            // The whole resolution, with the file as `--config` and nothing in the environment.
            std::fs::write(&devctl_file, &text).expect("writing devctl.toml");
            let overrides = devctl::config::Overrides {
                config: Some(devctl_file),
                ..Default::default()
            };
            let env: devctl::config::Env = [("HOME", fixture.dir.to_string_lossy().into_owned())]
                .into_iter()
                .collect();
            let defaults = devctl::config::Defaults {
                proxy_file: None,
                uid: None,
                token_file: None,
                ca_dir: fixture.dir.join("certificates"),
            };
            accepted(
                "devctl",
                devctl::config::resolve(&overrides, &env, &defaults),
            );
        }
        Err(error) => {
            let _ = render(&error);
        }
    }
});
