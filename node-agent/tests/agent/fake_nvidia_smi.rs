//! A stand-in `nvidia-smi`, shared by the backend's tests (`nvidia_smi.rs`) and the test of
//! `scripts/gpu-check.sh` (`gpu_check.rs`): a shell script the test writes, answering from files
//! of the state the test names, and keeping MIG state as the driver does.

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ongrid_agent::gpu::{from_config, GpuBackend, GpuBackendConfig};

pub const QUERY: &str = include_str!("../fixtures/nvidia-smi/a100x2.query.csv");
pub const LIST: &str = include_str!("../fixtures/nvidia-smi/a100x2.list.txt");

/// The fields of the agent's own query, in its order: the columns of `<state>.query`.
pub const FULL_FIELDS: &str =
    "uuid,name,memory.total,compute_cap,driver_version,mig.mode.current,pci.bus_id,utilization.gpu";

/// A stand-in nvidia-smi whose answers are files in its directory: `<state>.query` and
/// `<state>.list` (with `<state>.query.status`, `<state>.list.status` for exit statuses), the
/// state named in `state`; the state `hang` never answers.
///
/// `<state>.query` holds rows of the agent's own fields ([`FULL_FIELDS`]), printed as they are
/// for that query; a query for other fields (`index`, `mig.mode.pending` too) gets those columns
/// of each row, taken from `<state>.columns` where that file exists, so a test can make nvidia-smi
/// answer the agent one thing and another caller another. An unknown field is refused as
/// nvidia-smi refuses it. `--query-compute-apps=...` prints the file `apps`, `-q` one line.
///
/// MIG as the driver keeps it: `-i GPU -mig 1` turns MIG mode on (file `migmode.GPU`: the query
/// then says `Enabled`) and `-mig 0` off again (a file `mig-off-pending` leaves it on, printing
/// that file's warning), `mig -i GPU -cgi P1,P2 -C` appends one device per profile to `mig.GPU`
/// (listed under its GPU by `-L`), `-dci` fails with "No compute instances found" when there are
/// none, `-dgi` removes them; a file `mig-fail` makes `-cgi` fail with its text. `-i` takes a
/// UUID or an index. Every call is appended to `calls`.
///
/// [`FakeNvidiaSmi::pause_at`] makes the next call whose arguments contain a text wait, before
/// doing anything, until the test lets it go on: an event a test can act at.
pub struct FakeNvidiaSmi {
    pub dir: tempfile::TempDir,
    pub script: PathBuf,
}

impl FakeNvidiaSmi {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("nvidia-smi");
        let body = format!(
            r#"#!/bin/sh
dir='{dir}'
full='{FULL_FIELDS}'
state=$(cat "$dir/state")
if [ "$state" = hang ]; then exec sleep 600; fi
if [ -f "$dir/pause-at" ]; then
  case "$*" in
    *"$(cat "$dir/pause-at")"*)
      rm -f "$dir/pause-at"
      echo "$*" > "$dir/paused"
      read -r _ < "$dir/resume" ;;
  esac
fi
echo "$*" >> "$dir/calls"
status() {{ cat "$dir/$state.$1.status" 2>/dev/null || echo 0; }}
gpu_of() {{
  case "$1" in
    GPU-*) echo "$1" ;;
    *) sed -n "s/^GPU $1: .* (UUID: \(GPU-[^)]*\))$/\1/p" "$dir/$state.list" ;;
  esac
}}
case "$1" in
  -L)
    while IFS= read -r line; do
      echo "$line"
      u=$(echo "$line" | sed -n 's/^GPU [0-9]*: .* (UUID: \(GPU-[^)]*\))$/\1/p')
      if [ -n "$u" ] && [ -f "$dir/mig.$u" ]; then cat "$dir/mig.$u"; fi
    done < "$dir/$state.list"
    exit "$(status list)" ;;
  --query-gpu=*)
    fields=${{1#--query-gpu=}}
    source="$dir/$state.query"
    if [ "$fields" != "$full" ]; then
      for f in $(echo "$fields" | tr , ' '); do
        case ",index,$full,mig.mode.pending," in
          *",$f,"*) ;;
          *) echo "Field \"$f\" is not a valid field to query."; echo; exit 2 ;;
        esac
      done
      if [ -f "$dir/$state.columns" ]; then source="$dir/$state.columns"; fi
    fi
    i=0
    while IFS= read -r line; do
      u=${{line%%,*}}
      if [ -f "$dir/migmode.$u" ]; then line=$(echo "$line" | sed 's/, Disabled,/, Enabled,/'); fi
      if [ "$fields" = "$full" ]; then
        echo "$line"
      else
        echo "$i, $line" | awk -F', ' -v asked="$fields" -v names="index,$full" '
          BEGIN {{ n = split(names, name, ","); for (k = 1; k <= n; k++) column[name[k]] = k
                  column["mig.mode.pending"] = column["mig.mode.current"]; m = split(asked, want, ",") }}
          NF != n {{ sub(/^[0-9]+, /, ""); print; next }}
          {{ out = $(column[want[1]]); for (k = 2; k <= m; k++) out = out ", " $(column[want[k]]); print out }}'
      fi
      i=$((i+1))
    done < "$source"
    exit "$(status query)" ;;
  --query-compute-apps=*)
    cat "$dir/apps" 2>/dev/null ;;
  -q)
    echo "stand-in nvidia-smi, state $state" ;;
  -i)
    [ "$3" = -mig ] || {{ echo "unexpected arguments: $*" >&2; exit 99; }}
    u=$(gpu_of "$2")
    if [ "$4" = 0 ]; then
      echo "Disabled MIG Mode for GPU $u"
      if [ -f "$dir/mig-off-pending" ]; then cat "$dir/mig-off-pending"; else rm -f "$dir/migmode.$u"; fi
      echo "All done."
    else
      touch "$dir/migmode.$u"; echo "Enabled MIG Mode for GPU $u"; echo "All done."
    fi ;;
  mig)
    u=$(gpu_of "$3")
    case "$4" in
      -dci) [ -s "$dir/mig.$u" ] || {{ echo "No compute instances found: Not Found"; exit 6; }} ;;
      -dgi) [ -s "$dir/mig.$u" ] || {{ echo "No GPU instances found: Not Found"; exit 6; }}; rm -f "$dir/mig.$u" ;;
      -cgi)
        if [ -f "$dir/mig-fail" ]; then cat "$dir/mig-fail" >&2; exit 2; fi
        i=$(cat "$dir/mig.$u" 2>/dev/null | wc -l)
        for p in $(echo "$5" | tr , ' '); do
          echo "  MIG $p     Device  $i: (UUID: MIG-0000000$i-0000-4000-8000-${{u##*-}})" >> "$dir/mig.$u"
          echo "Successfully created GPU instance ID $i on GPU 0 using profile MIG $p (ID 9)"
          i=$((i+1))
        done ;;
      *) echo "unexpected arguments: $*" >&2; exit 99 ;;
    esac ;;
  *) echo "unexpected arguments: $*" >&2; exit 99 ;;
esac
exit 0
"#,
            dir = dir.path().display()
        );
        std::fs::write(&script, body).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let fake = Self { dir, script };
        fake.answer("ok", (QUERY, 0), (LIST, 0));
        fake.set("ok");
        // Another test's fork may still hold the new script open for writing (ETXTBSY) for a
        // moment: wait until it runs, so the backend's first discovery is not that accident.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Err(error) = std::process::Command::new(&fake.script).arg("-L").output() {
            assert!(
                error.raw_os_error() == Some(26) && Instant::now() < deadline,
                "{error}"
            );
            std::thread::yield_now();
        }
        std::fs::remove_file(fake.path("calls")).unwrap();
        fake
    }

    /// A file of the fake's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn answer(&self, state: &str, query: (&str, i32), list: (&str, i32)) {
        let dir = self.dir.path();
        std::fs::write(dir.join(format!("{state}.query")), query.0).unwrap();
        std::fs::write(
            dir.join(format!("{state}.query.status")),
            query.1.to_string(),
        )
        .unwrap();
        std::fs::write(dir.join(format!("{state}.list")), list.0).unwrap();
        std::fs::write(dir.join(format!("{state}.list.status")), list.1.to_string()).unwrap();
    }

    /// What a query for other fields than the agent's takes its columns from, in `state`.
    pub fn answer_other_queries(&self, state: &str, rows: &str) {
        std::fs::write(self.path(&format!("{state}.columns")), rows).unwrap();
    }

    /// The nvidia-smi calls made so far that changed MIG state, one per line.
    pub fn mig_calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("calls"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("mig ") || l.contains(" -mig "))
            .map(str::to_owned)
            .collect()
    }

    pub fn set(&self, state: &str) {
        std::fs::write(self.path("state"), state).unwrap();
    }

    pub fn kernel_log(&self) -> PathBuf {
        self.path("kmsg")
    }

    /// Whether MIG mode is on for `gpu`, and its MIG devices as `-L` lists them.
    pub fn mig_state(&self, gpu: &str) -> (bool, Vec<String>) {
        let on = self.path(&format!("migmode.{gpu}")).exists();
        let devices = std::fs::read_to_string(self.path(&format!("mig.{gpu}")))
            .unwrap_or_default()
            .lines()
            .map(|line| line.trim().to_owned())
            .collect();
        (on, devices)
    }

    /// The next call whose arguments contain `text` waits before doing anything: its arguments
    /// can be read from [`Pause::reached`], and it goes on at [`Pause::resume`].
    pub fn pause_at(&self, text: &str) -> Pause {
        for fifo in ["paused", "resume"] {
            nix::unistd::mkfifo(
                &self.path(fifo),
                nix::sys::stat::Mode::from_bits_truncate(0o600),
            )
            .unwrap();
        }
        std::fs::write(self.path("pause-at"), text).unwrap();
        Pause {
            paused: self.path("paused"),
            resume: self.path("resume"),
        }
    }

    /// The backend as the agent's config builds it.
    pub fn backend(&self, timeout: &str) -> Arc<dyn GpuBackend> {
        std::fs::write(self.kernel_log(), "").unwrap();
        from_config(&GpuBackendConfig::NvidiaSmi {
            path: Some(self.script.clone()),
            timeout: Some(timeout.to_owned()),
            kernel_log: Some(self.kernel_log()),
        })
        .unwrap()
    }
}

/// A call of the fake held at [`FakeNvidiaSmi::pause_at`].
pub struct Pause {
    paused: PathBuf,
    resume: PathBuf,
}

impl Pause {
    /// Waits (at most `limit`) until a call reaches the pause; returns its arguments.
    pub fn reached(&self, limit: Duration) -> Option<String> {
        let paused = self.paused.clone();
        let (sender, receiver) = std::sync::mpsc::channel();
        // Opening a FIFO for reading waits for its writer: the paused call.
        std::thread::spawn(move || {
            let _ = sender.send(std::fs::read_to_string(&paused));
        });
        receiver
            .recv_timeout(limit)
            .ok()
            .map(|read| read.unwrap().trim().to_owned())
    }

    /// Lets the paused call go on.
    pub fn resume(&self) {
        std::fs::write(&self.resume, "go\n").unwrap();
    }
}

impl Drop for Pause {
    /// Lets go of a call still paused and of a wait still open, so that a failed test leaves
    /// nothing blocked behind it.
    fn drop(&mut self) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let open_nonblocking = |path: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::libc::O_NONBLOCK)
                .open(path)
        };
        // Fails (ENXIO) when nobody reads: then nothing waits there.
        if let Ok(mut resume) = open_nonblocking(&self.resume) {
            let _ = resume.write_all(b"go\n");
        }
        let _ = open_nonblocking(&self.paused);
    }
}

/// `path` as text, for a command line.
pub fn text(path: &Path) -> &str {
    path.to_str().unwrap()
}
