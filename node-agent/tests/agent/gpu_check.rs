//! `scripts/gpu-check.sh` run here against the stand-in nvidia-smi ([`FakeNvidiaSmi`]) and this
//! build's `ongrid-agent`, so the check a machine with a real GPU will run cannot rot: each
//! step's verdict, a value the agent and nvidia-smi disagree on reported as FAIL, and the MIG
//! step putting the GPU back into its original mode on every exit path (the end of the check, a
//! failing step, SIGTERM in the middle of the change). `--docker` names a CLI that is not
//! there, so the container steps are SKIPPED, saying why; nothing here touches Docker.

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::fake_nvidia_smi::{text, FakeNvidiaSmi, LIST, QUERY};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");
const AGENT: &str = env!("CARGO_BIN_EXE_ongrid-agent");
/// The two A100s of the fixture host (PCI buses 07 and 0F).
const GPU0: &str = "GPU-08148167-439d-189d-b2e3-62da23b5f7b1";
const GPU1: &str = "GPU-eb3d02e1-a97d-8670-9761-924f871f590f";

/// One run of the check: its exit status and what it printed.
struct Check {
    output: Output,
}

impl Check {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    /// `(PASS|FAIL|SKIPPED, step)` of every verdict line, in order.
    fn verdicts(&self) -> Vec<(String, String)> {
        self.lines()
            .into_iter()
            .map(|(verdict, step, _)| (verdict, step))
            .collect()
    }

    fn lines(&self) -> Vec<(String, String, String)> {
        self.stdout()
            .lines()
            .filter_map(|line| {
                let (verdict, rest) = line.split_once(' ')?;
                let (step, reason) = rest.split_once(": ")?;
                ["PASS", "FAIL", "SKIPPED"]
                    .contains(&verdict)
                    .then(|| (verdict.to_owned(), step.to_owned(), reason.to_owned()))
            })
            .collect()
    }

    /// The reason given for `step`.
    fn reason(&self, step: &str) -> String {
        self.lines()
            .into_iter()
            .find(|(_, name, _)| name == step)
            .unwrap_or_else(|| panic!("no verdict for {step} in:\n{}", self.describe()))
            .2
    }

    fn code(&self) -> Option<i32> {
        self.output.status.code()
    }

    fn describe(&self) -> String {
        format!(
            "{}\nstderr:\n{}",
            self.stdout(),
            String::from_utf8_lossy(&self.output.stderr)
        )
    }
}

fn expected(verdicts: &[(&str, &str)]) -> Vec<(String, String)> {
    verdicts
        .iter()
        .map(|(verdict, step)| ((*verdict).to_owned(), (*step).to_owned()))
        .collect()
}

/// The check against `smi`, with this build's agent, no Docker and `extra` options.
fn command(smi: &FakeNvidiaSmi, extra: &[&str]) -> Command {
    if !smi.kernel_log().exists() {
        std::fs::write(smi.kernel_log(), "").unwrap();
    }
    let mut command = Command::new("bash");
    command
        .arg(SCRIPT)
        .args(["--agent", AGENT, "--nvidia-smi", text(&smi.script)])
        .args(["--kernel-log", text(&smi.kernel_log())])
        .args(["--docker", text(&smi.path("no-docker"))])
        .args(extra)
        .env("ONGRID_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn run(smi: &FakeNvidiaSmi, extra: &[&str]) -> Check {
    Check {
        output: command(smi, extra).output().unwrap(),
    }
}

#[test]
fn the_gpu_check_passes_against_a_fake_nvidia_smi_and_records_what_it_saw() {
    let smi = FakeNvidiaSmi::new();
    // A program's own Xid: not a GPU failure, for the agent and the script alike.
    std::fs::write(
        smi.kernel_log(),
        "4,1200,5000000,-;NVRM: Xid (PCI:0000:07:00): 13, pid=7, name=a.out, Graphics Exception\n",
    )
    .unwrap();
    let record = tempfile::tempdir().unwrap();
    let check = run(
        &smi,
        &["--allow-mig-changes", "--record", text(record.path())],
    );

    assert_eq!(
        check.verdicts(),
        expected(&[
            ("PASS", "agent"),
            ("PASS", "nvidia-smi"),
            ("PASS", "gpus"),
            ("PASS", &format!("discovery {GPU0}")),
            ("PASS", &format!("mig-support {GPU0}")),
            ("PASS", &format!("discovery {GPU1}")),
            ("PASS", &format!("mig-support {GPU1}")),
            ("PASS", &format!("health {GPU0}")),
            ("PASS", &format!("health {GPU1}")),
            ("SKIPPED", &format!("container {GPU0}")),
            ("PASS", &format!("mig {GPU0}")),
            ("PASS", &format!("mig-devices {GPU0}")),
            ("SKIPPED", "mig-container"),
            ("PASS", "mig-restore"),
        ]),
        "{}",
        check.describe()
    );
    assert_eq!(check.code(), Some(0), "{}", check.describe());
    assert!(check
        .stdout()
        .ends_with("gpu-check: 12 passed, 0 failed, 2 skipped\n"));
    assert_eq!(
        check.reason(&format!("discovery {GPU1}")),
        "model NVIDIA A100-SXM4-40GB, compute capability 8.0, memory MiB 40960, driver \
         535.129.03, PCI bus 00000000:0F:00.0, MIG enabled false"
    );
    assert!(check
        .reason(&format!("health {GPU0}"))
        .contains("1 Xid line(s)"));
    assert!(check
        .reason(&format!("container {GPU0}"))
        .starts_with("docker not found"));

    // The layout by UUID through the agent, then MIG mode off again through the agent.
    assert_eq!(
        smi.mig_calls(),
        [
            format!("-i {GPU0} -mig 1"),
            format!("mig -i {GPU0} -dci"),
            format!("mig -i {GPU0} -dgi"),
            format!("mig -i {GPU0} -cgi 1g.5gb -C"),
            format!("mig -i {GPU0} -dci"),
            format!("mig -i {GPU0} -dgi"),
            format!("-i {GPU0} -mig 0"),
        ]
    );
    assert_eq!(smi.mig_state(GPU0), (false, Vec::new()));
    assert_eq!(
        check.reason(&format!("mig-devices {GPU0}")),
        "nvidia-smi -L and the agent list the same: MIG-00000000-0000-4000-8000-62da23b5f7b1 1g.5gb"
    );

    // What it saw, under fixture names.
    let recorded = |name: &str| std::fs::read_to_string(record.path().join(name)).unwrap();
    assert_eq!(recorded("a100-sxm4-40gbx2.query.csv"), QUERY);
    assert_eq!(recorded("a100-sxm4-40gbx2.list.txt"), LIST);
    assert!(recorded("a100-sxm4-40gbx2-mig.list.txt").contains("  MIG 1g.5gb     Device  0: "));
    assert!(recorded("a100-sxm4-40gbx2-mig.query.csv").contains(", Enabled, "));
    assert_eq!(
        recorded("a100-sxm4-40gbx2.xid.txt"),
        std::fs::read_to_string(smi.kernel_log()).unwrap()
    );
    let agent: serde_json::Value =
        serde_json::from_str(&recorded("a100-sxm4-40gbx2.agent.json")).unwrap();
    assert_eq!(agent[1]["uuid"], GPU1);
    assert_eq!(agent[1]["mig_model"], "A100-40GB");
    let calls = recorded("agent-calls.tsv");
    assert!(
        calls.contains(&format!("\t0\tnvidia-smi mig -i {GPU0} -cgi 1g.5gb -C\n")),
        "{calls}"
    );
    let stdout = check.stdout();
    let verdict_lines: Vec<&str> = stdout
        .lines()
        .filter(|line| !line.starts_with("gpu-check:"))
        .collect();
    assert_eq!(
        recorded("gpu-check.txt").lines().collect::<Vec<_>>(),
        verdict_lines
    );
}

#[test]
fn a_value_the_agent_and_nvidia_smi_disagree_on_is_a_failure() {
    let smi = FakeNvidiaSmi::new();
    // nvidia-smi tells the script's own query another memory size for GPU 1 than the agent's.
    let other: String = QUERY
        .lines()
        .map(|row| {
            if row.starts_with(GPU1) {
                row.replace(", 40960, ", ", 40000, ")
            } else {
                row.to_owned()
            }
        })
        .map(|row| row + "\n")
        .collect();
    smi.answer_other_queries("ok", &other);
    // GPU 0 fell off the bus, as the kernel log says; a program runs on it.
    std::fs::write(
        smi.kernel_log(),
        "6,1201,5000000,-;NVRM: Xid (PCI:0000:07:00): 79, pid=0, name=python, GPU has fallen off the bus.\n",
    )
    .unwrap();
    std::fs::write(smi.path("apps"), format!("{GPU0}, 4242, python\n")).unwrap();

    let check = run(&smi, &["--allow-mig-changes"]);
    assert_eq!(
        check.verdicts(),
        expected(&[
            ("PASS", "agent"),
            ("PASS", "nvidia-smi"),
            ("PASS", "gpus"),
            ("PASS", &format!("discovery {GPU0}")),
            ("PASS", &format!("mig-support {GPU0}")),
            ("FAIL", &format!("discovery {GPU1}")),
            ("PASS", &format!("mig-support {GPU1}")),
            ("FAIL", &format!("health {GPU0}")),
            ("PASS", &format!("health {GPU1}")),
            ("SKIPPED", &format!("container {GPU0}")),
            ("SKIPPED", &format!("mig {GPU0}")),
        ]),
        "{}",
        check.describe()
    );
    assert_eq!(check.code(), Some(1), "{}", check.describe());
    assert_eq!(
        check.reason(&format!("discovery {GPU1}")),
        "memory MiB: agent 40960, nvidia-smi 40000"
    );
    let health = check.reason(&format!("health {GPU0}"));
    assert!(
        health.starts_with("not healthy, as the agent says (failed: Xid 79 at "),
        "{health}"
    );
    assert!(health.contains("fatal Xid 79: "), "{health}");
    assert_eq!(
        check.reason(&format!("mig {GPU0}")),
        format!("processes run on it: {GPU0}, 4242, python")
    );
    assert!(smi.mig_calls().is_empty(), "{:?}", smi.mig_calls());
}

#[test]
fn a_failing_mig_step_still_puts_the_gpu_back() {
    let smi = FakeNvidiaSmi::new();
    std::fs::write(
        smi.path("mig-fail"),
        "Unable to create a GPU instance on GPU 0 using profile 19: Insufficient Resources",
    )
    .unwrap();
    let check = run(&smi, &["--allow-mig-changes", "--mig-layout", "1g.5gb*2"]);
    let mig: Vec<(String, String)> = check
        .verdicts()
        .into_iter()
        .filter(|(_, step)| step.starts_with("mig ") || step == "mig-restore")
        .collect();
    assert_eq!(
        mig,
        expected(&[("FAIL", &format!("mig {GPU0}")), ("PASS", "mig-restore")]),
        "{}",
        check.describe()
    );
    assert!(check
        .reason(&format!("mig {GPU0}"))
        .contains("Insufficient Resources"));
    assert_eq!(check.code(), Some(1));
    assert_eq!(smi.mig_state(GPU0), (false, Vec::new()));
    assert_eq!(
        smi.mig_calls().last().unwrap(),
        &format!("-i {GPU0} -mig 0")
    );
}

#[test]
fn sigterm_in_the_middle_of_the_mig_change_still_puts_the_gpu_back() {
    let smi = FakeNvidiaSmi::new();
    let pause = smi.pause_at("-cgi");
    let mut child = command(&smi, &["--allow-mig-changes"]).spawn().unwrap();

    // MIG mode is on and the instances are being made: the check is told to stop.
    let Some(paused) = pause.reached(Duration::from_secs(60)) else {
        child.kill().unwrap();
        let output = child.wait_with_output().unwrap();
        panic!(
            "the check never made the layout:\n{}",
            Check { output }.describe()
        );
    };
    assert_eq!(paused, format!("mig -i {GPU0} -cgi 1g.5gb -C"));
    assert_eq!(smi.mig_state(GPU0), (true, Vec::new()));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    pause.resume();

    let check = Check {
        output: child.wait_with_output().unwrap(),
    };
    assert_eq!(check.code(), Some(143), "{}", check.describe());
    let tail: Vec<(String, String)> = check.verdicts().into_iter().rev().take(2).collect();
    assert_eq!(
        tail,
        expected(&[("PASS", "mig-restore"), ("FAIL", "interrupted")]),
        "{}",
        check.describe()
    );
    assert!(!check.stdout().contains(&format!("PASS mig {GPU0}")));
    assert!(
        check
            .stdout()
            .ends_with("gpu-check: 10 passed, 1 failed, 1 skipped\n"),
        "{}",
        check.describe()
    );
    assert_eq!(smi.mig_state(GPU0), (false, Vec::new()));
}

#[test]
fn a_gpu_found_in_mig_mode_stays_in_it() {
    let smi = FakeNvidiaSmi::new();
    std::fs::write(smi.path(&format!("migmode.{GPU0}")), "").unwrap();
    let check = run(&smi, &["--allow-mig-changes"]);
    let mig: Vec<(String, String)> = check
        .verdicts()
        .into_iter()
        .filter(|(_, step)| step.starts_with("mig ") || step == "mig-restore")
        .collect();
    assert_eq!(
        mig,
        expected(&[("PASS", &format!("mig {GPU0}")), ("PASS", "mig-restore")]),
        "{}",
        check.describe()
    );
    assert_eq!(smi.mig_state(GPU0), (true, Vec::new()));
    assert!(
        !smi.mig_calls().iter().any(|call| call.contains(" -mig ")),
        "{:?}",
        smi.mig_calls()
    );
}
