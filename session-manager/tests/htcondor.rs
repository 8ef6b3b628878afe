//! The HTCondor target without HTCondor daemons (none exist for Debian):
//!
//! - every submit description ongrid writes goes through HTCondor's own parser, offline
//!   (`htcondor.Submit(text).jobs(clusterid=1)` of the PyPI package `htcondor>=24,<25`, see
//!   `tests/htcondor/check_submit.py`), and the resulting job ads are checked attribute by
//!   attribute and matched against the machine ads of an A100 and an H100 slot;
//! - arguments and environment values with quotes, spaces and `$` come back from HTCondor's job
//!   ad exactly as given;
//! - recorded `condor_q -json` / `condor_history -json` outputs map to ongrid's phases;
//! - the command path runs stand-in `condor_*` tools that record their arguments and print the
//!   recorded outputs.
//!
//! Needs `python3` with `htcondor>=24,<25`: `python3 -m pip install -r
//! deploy/python-requirements.txt` (`deploy/install-packages.sh tests` does it). Another
//! interpreter can be named in `ONGRID_PYTHON`.

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use chrono::Utc;
use ongrid_core::job::{JobId, JobSpecFile, RestartChain};
use ongrid_core::MemorySize;
use ongrid_manager::domain::grid_jobs::{LocalAccount, Phase};
use ongrid_manager::targets::htcondor::status::{self, HALT_HOLD_REASON};
use ongrid_manager::targets::htcondor::submit::{render, SubmitSite};
use ongrid_manager::targets::htcondor::{constraint, Htcondor};
use ongrid_manager::targets::{HtcondorConfig, RunAs, Target, TargetError, TargetJob, Tracked};
use serde_json::Value;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    manifest_dir().join("tests/fixtures/htcondor").join(name)
}

fn job_id(n: u32) -> JobId {
    format!("{n:08}-0000-4000-8000-0000000000{:02}", n % 100)
        .parse()
        .unwrap()
}

fn spec_job(n: u32, toml: &str) -> TargetJob {
    let spec = JobSpecFile::from_toml(toml)
        .unwrap()
        .validate(Utc::now())
        .unwrap();
    let id = job_id(n);
    TargetJob {
        id,
        max_duration: spec.max_duration,
        spec,
        sif: PathBuf::from(
            "/srv/ongrid/images/sha256/9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.sif",
        ),
        account: LocalAccount::parse("alice").unwrap(),
        chain: RestartChain::first(id),
    }
}

/// The site's settings, with job directories under `output_dir` (HTCondor's parser checks
/// that a job's `initialdir` exists, as `condor_submit` does).
fn site(output_dir: &Path) -> SubmitSite {
    SubmitSite {
        output_dir: output_dir.to_owned(),
        request_disk: MemorySize::parse("20G").unwrap(),
        extra_lines: vec!["+AccountingGroup = \"group_grid.alice\"".to_owned()],
    }
}

// ---------------------------------------------------------------------------------------------
// HTCondor's own parser.

fn python() -> String {
    std::env::var("ONGRID_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

const INSTALL: &str = "python3 -m pip install -r deploy/python-requirements.txt (or run \
                       deploy/install-packages.sh tests as root)";

/// Runs `check_submit.py` over `descriptions`; per description its job ad (ClassAd JSON) and
/// which slots it matches, or HTCondor's error.
fn htcondor_parse(descriptions: &BTreeMap<String, String>) -> BTreeMap<String, Value> {
    let python = python();
    let version = Command::new(&python)
        .args(["-c", "import htcondor; print(htcondor.version())"])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {python} ({e}): these tests need Python 3 with htcondor>=24,<25: {INSTALL}")
        });
    let version_text = String::from_utf8_lossy(&version.stdout);
    assert!(
        version.status.success(),
        "{python} cannot import htcondor ({}): install it: {INSTALL}",
        String::from_utf8_lossy(&version.stderr).trim()
    );
    assert!(
        version_text.contains("$CondorVersion: 24."),
        "{python} has HTCondor {} but these tests need htcondor>=24,<25 (25.x dropped \
         Submit.jobs()): {INSTALL}",
        version_text.trim()
    );
    let machines: BTreeMap<&str, String> = [("a100", "slot_a100.ad"), ("h100", "slot_h100.ad")]
        .into_iter()
        .map(|(name, file)| (name, std::fs::read_to_string(fixture(file)).unwrap()))
        .collect();
    let request = serde_json::json!({ "descriptions": descriptions, "machines": machines });
    let mut child = Command::new(&python)
        .arg(manifest_dir().join("tests/htcondor/check_submit.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "check_submit.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// HTCondor's new-syntax raw form (as the job ad's `Arguments` and `Environment` hold it)
/// split into its words: white space separates, `'...'` groups, `''` inside is a `'`.
fn split_v2(raw: &str) -> Vec<String> {
    let chars: Vec<char> = raw.chars().collect();
    let (mut words, mut word, mut in_word, mut quoted) = (Vec::new(), String::new(), false, false);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if quoted {
            if c == '\'' && chars.get(i + 1) == Some(&'\'') {
                word.push('\'');
                i += 1;
            } else if c == '\'' {
                quoted = false;
            } else {
                word.push(c);
            }
        } else if c == '\'' {
            quoted = true;
            in_word = true;
        } else if c.is_whitespace() {
            if in_word {
                words.push(std::mem::take(&mut word));
                in_word = false;
            }
        } else {
            word.push(c);
            in_word = true;
        }
        i += 1;
    }
    if in_word {
        words.push(word);
    }
    words
}

fn ad_env(ad: &Value) -> BTreeMap<String, String> {
    split_v2(ad["Environment"].as_str().unwrap())
        .into_iter()
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

#[test]
fn submit_descriptions_pass_htcondors_parser_with_the_intended_attributes() {
    let jobs = [
        (
            "plain",
            spec_job(
                1,
                r#"image = "mymodel:v1"
command = ["python", "train.py", "--epochs", "20"]
env = { EPOCHS = "20" }
restartable = true"#,
            ),
        ),
        (
            "hopper",
            spec_job(
                2,
                r#"image = "mymodel:v1"
command = ["python", "train.py"]
min_capability = "9.0"
max_duration = "8h"
min_duration = "1h""#,
            ),
        ),
        (
            "big_memory",
            spec_job(
                3,
                r#"image = "mymodel:v1"
command = ["python", "train.py"]
min_gpu_memory = "80G""#,
            ),
        ),
        (
            "two_ampere",
            spec_job(
                4,
                r#"image = "mymodel:v1"
command = ["python", "train.py"]
gpus = 2
min_capability = "8.0"
cpus = 4.5
memory = "16G""#,
            ),
        ),
        (
            "four_gpus",
            spec_job(
                5,
                r#"image = "mymodel:v1"
command = ["python", "train.py"]
gpus = 4"#,
            ),
        ),
        (
            "many_cpus",
            spec_job(
                6,
                r#"image = "mymodel:v1"
command = ["python", "train.py"]
cpus = 32"#,
            ),
        ),
    ];
    let out = tempfile::tempdir().unwrap();
    let site = site(out.path());
    let descriptions: BTreeMap<String, String> = jobs
        .iter()
        .map(|(name, job)| {
            std::fs::create_dir(site.job_dir(job.id)).unwrap();
            ((*name).to_owned(), render(job, &site).unwrap())
        })
        .collect();
    let parsed = htcondor_parse(&descriptions);
    let ad = |name: &str| -> &Value {
        let entry = &parsed[name];
        assert!(
            entry.get("error").is_none(),
            "HTCondor refused {name}: {}\n{}",
            entry["error"],
            descriptions[name]
        );
        &entry["ad"]
    };
    let matches = |name: &str| -> (bool, bool) {
        let m = &parsed[name]["matches"];
        (m["a100"].as_bool().unwrap(), m["h100"].as_bool().unwrap())
    };

    // Everything every job gets.
    for (name, job) in &jobs {
        let ad = ad(name);
        assert_eq!(ad["JobUniverse"], 5, "{name}: the container universe");
        assert_eq!(ad["WantContainer"], true, "{name}");
        assert_eq!(
            ad["ContainerImage"],
            job.sif.display().to_string(),
            "{name}"
        );
        assert_eq!(ad["TransferContainer"], false, "{name}");
        assert_eq!(ad["ContainerTargetDir"], "/ongrid/work", "{name}");
        assert_eq!(ad["Cmd"], "python", "{name}");
        assert_eq!(ad["TransferExecutable"], false, "{name}");
        assert_eq!(ad["SuccessCheckpointExitCode"], 85, "{name}");
        assert_eq!(ad["TransferCheckpoint"], "checkpoint", "{name}");
        assert_eq!(ad["WantFTOnCheckpoint"], true, "{name}");
        assert_eq!(ad["KillSig"], "SIGUSR1", "{name}");
        assert_eq!(ad["JobMaxVacateTime"], 15, "{name}");
        assert_eq!(ad["RequestDisk"], 19_531_250, "{name}: 20G in KiB");
        assert_eq!(ad["OngridJobId"], job.id.to_string(), "{name}");
        assert_eq!(ad["JobBatchName"], format!("ongrid-{}", job.id), "{name}");
        let job_dir = site.job_dir(job.id).display().to_string();
        assert_eq!(ad["Iwd"], job_dir, "{name}");
        assert_eq!(ad["Out"], "job.out", "{name}");
        assert_eq!(ad["Err"], "job.out", "{name}: stdout and stderr together");
        assert_eq!(ad["UserLog"], format!("{job_dir}/job.log"), "{name}");
        assert_eq!(
            ad["AccountingGroup"], "group_grid.alice",
            "{name}: the site's extra line"
        );
        let env = ad_env(ad);
        assert_eq!(env["ONGRID_JOB_ID"], job.id.to_string(), "{name}");
        assert_eq!(env["ONGRID_RESTART_COUNT"], "0", "{name}");
        assert_eq!(
            env["ONGRID_RESTART_INITIAL_JOB_ID"],
            job.id.to_string(),
            "{name}"
        );
        let requirements = ad["Requirements"].as_str().unwrap();
        let gpus_matched = if ad.get("RequireGPUs").is_some() {
            "countMatches(MY.RequireGPUs,TARGET.AvailableGPUs) >= RequestGPUs"
        } else {
            "TARGET.GPUs >= RequestGPUs"
        };
        assert!(
            requirements.contains(gpus_matched)
                && requirements.contains("TARGET.HasSIF")
                && requirements.contains("TARGET.HasSelfCheckpointTransfers"),
            "{name}: {requirements}"
        );
    }

    let plain = ad("plain");
    assert_eq!(plain["RequestGPUs"], 1);
    assert_eq!(plain["RequestCpus"], 1);
    assert!(plain.get("GPUsMinCapability").is_none() && plain.get("RequireGPUs").is_none());
    assert!(
        plain.get("AllowedJobDuration").is_none(),
        "no max duration, no limit"
    );
    assert!(
        plain.get("PeriodicRemove").is_none(),
        "restartable: run again after eviction"
    );
    assert_eq!(
        split_v2(plain["Arguments"].as_str().unwrap()),
        ["train.py", "--epochs", "20"]
    );
    assert_eq!(ad_env(plain)["EPOCHS"], "20");
    assert_eq!(matches("plain"), (true, true));

    let hopper = ad("hopper");
    assert_eq!(hopper["GPUsMinCapability"], 9.0);
    assert_eq!(
        hopper["RequireGPUs"],
        "/Expr(Capability >= GPUsMinCapability)/"
    );
    assert_eq!(hopper["AllowedJobDuration"], 8 * 3600, "maxDuration");
    assert_eq!(hopper["MaxJobRetirementTime"], 3600, "minDuration");
    assert_eq!(
        hopper["PeriodicRemove"], "/Expr(JobStatus == 1 && NumJobStarts > 0)/",
        "not restartable: removed after an eviction"
    );
    assert_eq!(
        matches("hopper"),
        (false, true),
        "capability 9.0: the H100 only"
    );

    let big = ad("big_memory");
    assert_eq!(
        big["GPUsMinMemory"], 76_294,
        "80G = 80e9 bytes in MiB, rounded up"
    );
    assert_eq!(
        big["RequireGPUs"],
        "/Expr(GlobalMemoryMb >= GPUsMinMemory)/"
    );
    assert_eq!(matches("big_memory"), (false, true), "80 GB: the H100 only");

    let two = ad("two_ampere");
    assert_eq!(two["RequestGPUs"], 2);
    assert_eq!(two["GPUsMinCapability"], 8.0);
    assert_eq!(two["RequestCpus"], 5, "4.5 CPUs rounded up");
    assert_eq!(two["RequestMemory"], 15_259, "16G in MiB, rounded up");
    assert_eq!(matches("two_ampere"), (true, true));

    assert_eq!(ad("four_gpus")["RequestGPUs"], 4);
    assert_eq!(matches("four_gpus"), (false, false), "no slot has 4 GPUs");
    assert_eq!(ad("many_cpus")["RequestCpus"], 32);
    assert_eq!(matches("many_cpus"), (false, false), "no slot has 32 CPUs");
}

#[test]
fn arguments_and_environment_come_back_from_htcondor_exactly() {
    let nasty = [
        "two words",
        "it's",
        "say \"hi\"",
        "'quoted'",
        "",
        "tab\there",
        "$HOME",
        "$(HOME)",
        "$ENV(HOME)",
        "$$",
        "a$",
        "100%",
        "#not a comment",
        "back\\slash\\",
        "=x=",
        "ünïcödé ✓",
        "--flag=$x and $(y)",
        "$(DOLLAR",
        "$(DOLLAR )",
        "ctrl\u{1}\u{1b}[0m\u{7f}",
    ];
    // Every printable ASCII character: all of them in one argument, and each alone.
    let printable: String = (' '..='~').collect();
    let args: Vec<String> = nasty
        .iter()
        .map(|s| (*s).to_owned())
        .chain([printable.clone()])
        .chain(printable.chars().map(String::from))
        .collect();
    let mut argv = vec!["python".to_owned()];
    argv.extend(args.iter().cloned());
    let env: BTreeMap<String, String> = args
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("V{i}"), v.clone()))
        .collect();
    let mut job = spec_job(7, "image = \"mymodel:v1\"\ncommand = [\"python\"]");
    job.spec.command = ongrid_core::job::Command::new(argv).unwrap();
    job.spec.env = ongrid_core::job::JobEnv::new(env.clone()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let site = site(out.path());
    std::fs::create_dir(site.job_dir(job.id)).unwrap();
    let mut descriptions = BTreeMap::new();
    descriptions.insert("nasty".to_owned(), render(&job, &site).unwrap());
    let parsed = htcondor_parse(&descriptions);
    let ad = &parsed["nasty"]["ad"];
    assert!(ad.is_object(), "HTCondor refused it: {}", parsed["nasty"]);
    assert_eq!(
        split_v2(ad["Arguments"].as_str().unwrap()),
        args,
        "{}",
        descriptions["nasty"]
    );
    let back = ad_env(ad);
    for (name, value) in &env {
        assert_eq!(&back[name], value, "{name}: {}", descriptions["nasty"]);
    }
}

#[test]
fn what_a_submit_description_cannot_carry_is_refused_with_the_reason() {
    let site = site(Path::new("/var/lib/ongrid/htcondor"));
    let mut job = spec_job(
        8,
        "image = \"mymodel:v1\"\ncommand = [\"python\", \"a\\nb\"]",
    );
    let err = render(&job, &site).unwrap_err().to_string();
    assert!(err.contains("argument 1 contains a line break"), "{err}");
    assert!(err.contains("--to local"), "{err}");
    job.spec.command =
        ongrid_core::job::Command::new(vec!["sh".into(), "-c".into(), "echo $$(id)".into()])
            .unwrap();
    let err = render(&job, &site).unwrap_err().to_string();
    assert!(err.contains("argument 2 contains \"$$(\""), "{err}");
    // HTCondor reads a literal $(DOLLAR), in any case, back as "$": refused, not changed.
    for text in ["$(DOLLAR)", "cost: $(dollar)5"] {
        job.spec.command =
            ongrid_core::job::Command::new(vec!["echo".into(), text.into()]).unwrap();
        let err = render(&job, &site).unwrap_err().to_string();
        assert!(err.contains("argument 1 contains \"$(DOLLAR)\""), "{err}");
        assert!(err.contains("--to local"), "{err}");
    }
    job.spec.command = ongrid_core::job::Command::new(vec!["true".into()]).unwrap();
    job.spec.env = ongrid_core::job::JobEnv::new(BTreeMap::from([(
        "PRICE".to_owned(),
        "$(Dollar)".to_owned(),
    )]))
    .unwrap();
    let err = render(&job, &site).unwrap_err().to_string();
    assert!(
        err.contains("the value of PRICE contains \"$(DOLLAR)\""),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// condor_q and condor_history.

fn observations(file: &str) -> BTreeMap<String, (Phase, String, Option<JobId>, String)> {
    let text = std::fs::read_to_string(fixture(file)).unwrap();
    status::parse_ads(&text)
        .unwrap()
        .iter()
        .map(|ad| {
            let o = ad.observation();
            assert_eq!(o.restarts, 0);
            (o.engine_id.to_string(), (o.phase, o.raw, o.job, o.hosts))
        })
        .collect()
}

fn why(phase: &Phase) -> &str {
    match phase {
        Phase::Pending { why } => why.as_deref().unwrap_or(""),
        Phase::Halted { message } | Phase::Cancelled { message } | Phase::Failed { message } => {
            message
        }
        other => panic!("no words in {other:?}"),
    }
}

#[test]
fn condor_q_states_and_reasons() {
    let q = observations("condor_q.json");
    assert_eq!(q.len(), 8);

    let (phase, raw, job, _) = &q["4711.0"];
    assert!(matches!(phase, Phase::Pending { .. }));
    assert!(
        why(phase).contains("no HTCondor machine offers what it asks"),
        "{phase:?}"
    );
    assert_eq!(raw, "Idle (no match found)");
    assert_eq!(*job, Some(job_id(11)));

    let (phase, raw, _, hosts) = &q["4712.0"];
    assert_eq!(*phase, Phase::Running);
    assert_eq!(raw, "Running");
    assert_eq!(hosts, "slot1_1@gpu-h100-01.example.org");

    let (phase, raw, _, hosts) = &q["4713.0"];
    assert_eq!(
        *phase,
        Phase::TimeLimit,
        "hold code 46: allowed_job_duration"
    );
    assert_eq!(
        raw,
        "Held (46: The job exceeded allowed job duration of 8:00:00)"
    );
    assert_eq!(hosts, "slot1_2@gpu-a100-01.example.org");

    let (phase, _, _, _) = &q["4714.0"];
    assert!(matches!(phase, Phase::Halted { .. }), "{phase:?}");
    assert!(
        why(phase).starts_with("halted: HTCondor sent SIGUSR1"),
        "{phase:?}"
    );

    let (phase, _, _, _) = &q["4715.0"];
    assert!(matches!(phase, Phase::Failed { .. }), "{phase:?}");
    let words = why(phase);
    assert!(
        words.starts_with(
            "it used more memory or disk than it asked for: submit it again with more --memory"
        ) && words.contains("Peak usage: 17012 megabytes")
            && words.ends_with("(hold code 34)"),
        "{words}"
    );

    let (phase, _, _, hosts) = &q["4716.0"];
    assert_eq!(
        why(phase),
        "HTCondor evicted it from slot1_1@gpu-h100-01.example.org (Claim deactivated by the \
         startd (PREEMPT)); it waits to run again, from its last checkpoint"
    );
    assert_eq!(hosts, "slot1_1@gpu-h100-01.example.org");

    let (phase, _, _, _) = &q["4717.0"];
    assert!(
        matches!(phase, Phase::Pending { .. }),
        "an admin's hold may be released"
    );
    assert!(
        why(phase).contains("via condor_hold (by user condor)"),
        "{phase:?}"
    );

    let (phase, raw, job, _) = &q["4718.0"];
    assert_eq!(*phase, Phase::Running, "suspended still holds its slot");
    assert_eq!(raw, "Suspended");
    assert_eq!(
        *job,
        Some(job_id(18)),
        "from JobBatchName when OngridJobId is missing"
    );
}

#[test]
fn condor_history_states_and_reasons() {
    let h = observations("condor_history.json");
    assert_eq!(h["4700.0"].0, Phase::Exited { code: 0 });
    assert_eq!(h["4700.0"].1, "Completed (exit code 0)");
    assert_eq!(h["4700.0"].3, "slot1_1@gpu-h100-01.example.org");
    assert_eq!(h["4701.0"].0, Phase::Exited { code: 3 });
    assert_eq!(
        h["4702.0"].0,
        Phase::Failed {
            message: "its program was killed by signal 9".to_owned()
        }
    );
    assert_eq!(
        h["4703.0"].0,
        Phase::Cancelled {
            message: "removed from HTCondor's queue: via condor_rm (by user alice)".to_owned()
        }
    );
    let (phase, _, _, _) = &h["4704.0"];
    assert!(matches!(phase, Phase::Failed { .. }), "{phase:?}");
    assert!(
        why(phase)
            .contains("evicted it from slot1_1@gpu-a100-01.example.org and it is not restartable"),
        "{phase:?}"
    );
}

#[test]
fn output_that_is_not_classad_json_is_an_error_and_nothing_is_no_jobs() {
    assert!(status::parse_ads("").unwrap().is_empty());
    assert!(status::parse_ads("\n").unwrap().is_empty());
    let err = status::parse_ads("-- Schedd: submit.example.org : <10.0.0.1:9618?...\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not ClassAd JSON"), "{err}");
    let err = status::parse_ads(r#"[{"ClusterId": 1, "ProcId": 0, "JobStatus": 9}]"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("JobStatus 9"), "{err}");
    let err = status::parse_ads(r#"[{"ClusterId": 1, "JobStatus": 2}]"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no ProcId"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// The command path, through stand-in tools.

struct StandIns {
    dir: tempfile::TempDir,
}

impl StandIns {
    /// `condor_*` stand-ins in a temporary directory: each writes its arguments, one a line,
    /// to `<name>.args` (condor_submit also its stdin to `condor_submit.stdin`) and prints what
    /// the real tool would.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let record = |name: &str| format!("printf '%s\\n' \"$@\" > {d}/{name}.args\n");
        let scripts = [
            (
                "condor_submit",
                format!(
                    "{}cat > {d}/condor_submit.stdin\nprintf '4721.0 - 4721.0\\n'\n",
                    record("condor_submit")
                ),
            ),
            (
                "condor_submit_refusing",
                format!(
                    "{}cat > /dev/null\nprintf 'Submitting job(s)\\nERROR: Submit requirement GPUsLimit evaluated to false: at most 8 GPUs per job\\n' >&2\nexit 1\n",
                    record("condor_submit_refusing")
                ),
            ),
            (
                "condor_q",
                format!("{}cat {}\n", record("condor_q"), fixture("condor_q.json").display()),
            ),
            (
                "condor_history",
                format!(
                    "{}cat {}\n",
                    record("condor_history"),
                    fixture("condor_history.json").display()
                ),
            ),
            (
                "condor_rm",
                format!(
                    "{}case \"$*\" in *9999.0*) echo 'Job 9999.0 not found' >&2; exit 1;; esac\necho 'All jobs matching the given job IDs have been marked for removal.'\n",
                    record("condor_rm")
                ),
            ),
            (
                "condor_hold",
                format!("{}echo 'Job 4712.0 held'\n", record("condor_hold")),
            ),
            (
                "runas",
                format!("echo \"$1\" >> {d}/runas.log\nshift\nexec \"$@\"\n"),
            ),
        ];
        for (name, body) in scripts {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::create_dir(dir.path().join("out")).unwrap();
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn config(&self) -> HtcondorConfig {
        HtcondorConfig {
            condor_submit: self.path("condor_submit"),
            condor_q: self.path("condor_q"),
            condor_history: self.path("condor_history"),
            condor_rm: self.path("condor_rm"),
            condor_hold: self.path("condor_hold"),
            image_dir: PathBuf::from("/srv/ongrid/images"),
            output_dir: self.path("out"),
            request_disk: MemorySize::parse("20G").unwrap(),
            run_as: RunAs(vec![
                self.path("runas").display().to_string(),
                "{account}".into(),
            ]),
            extra_lines: Vec::new(),
        }
    }

    /// The arguments a stand-in was last run with; `None` if it never ran.
    fn args(&self, name: &str) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.path(&format!("{name}.args"))).ok()?;
        Some(text.lines().map(str::to_owned).collect())
    }

    fn accounts(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("runas.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn tracked(n: u32, engine_id: Option<&str>) -> Tracked {
    Tracked {
        job: job_id(n),
        engine_id: engine_id
            .map(|id| ongrid_manager::domain::grid_jobs::EngineJobId::parse(id).unwrap()),
        account: LocalAccount::parse("alice").unwrap(),
        engine_restarts: 0,
    }
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

#[test]
fn submit_hands_condor_submit_the_description_as_the_account() {
    let stand_ins = StandIns::new();
    let target = Htcondor::new(stand_ins.config());
    let job = spec_job(
        30,
        "image = \"mymodel:v1\"\ncommand = [\"python\", \"train.py\"]",
    );
    let id = block_on(target.submit(&job)).unwrap();
    assert_eq!(id.as_str(), "4721.0", "the cluster.proc of -terse");
    assert_eq!(stand_ins.args("condor_submit").unwrap(), ["-terse", "-"]);
    let sent = std::fs::read_to_string(stand_ins.path("condor_submit.stdin")).unwrap();
    assert_eq!(sent, target.describe_job(&job).unwrap());
    assert!(sent.contains(&format!(
        "initialdir = {}",
        target.job_dir(job.id).display()
    )));
    assert!(
        target.job_dir(job.id).is_dir(),
        "its initialdir exists before condor_submit"
    );
    assert_eq!(
        stand_ins.accounts(),
        ["alice", "alice"],
        "mkdir and condor_submit as alice"
    );
}

#[test]
fn a_refusal_by_condor_submit_is_the_jobs_reason() {
    let stand_ins = StandIns::new();
    let mut config = stand_ins.config();
    config.condor_submit = stand_ins.path("condor_submit_refusing");
    let target = Htcondor::new(config);
    let job = spec_job(
        31,
        "image = \"mymodel:v1\"\ncommand = [\"python\", \"train.py\"]",
    );
    match block_on(target.submit(&job)) {
        Err(TargetError::Refused(words)) => assert_eq!(
            words,
            "ERROR: Submit requirement GPUsLimit evaluated to false: at most 8 GPUs per job"
        ),
        other => panic!("{other:?}"),
    }
    let mut config = stand_ins.config();
    config.condor_submit = stand_ins.path("no_such_condor_submit");
    match block_on(Htcondor::new(config).submit(&job)) {
        Err(TargetError::Unavailable(words)) => {
            assert!(
                words.contains("check the path in [targets.htcondor]"),
                "{words}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn status_asks_the_queue_then_the_history_for_the_rest() {
    let stand_ins = StandIns::new();
    let target = Htcondor::new(stand_ins.config());
    let jobs = [
        tracked(11, Some("4711.0")),
        tracked(12, Some("4712.0")),
        tracked(20, Some("4700.0")),
        tracked(99, None),
    ];
    let observations = block_on(target.status(&jobs)).unwrap();
    let attributes = status::ATTRIBUTES.join(",");
    assert_eq!(
        stand_ins.args("condor_q").unwrap(),
        [
            "-allusers",
            "-json",
            "-attributes",
            &attributes,
            "-constraint",
            &constraint([job_id(11), job_id(12), job_id(20), job_id(99)]),
        ]
    );
    assert_eq!(
        stand_ins.args("condor_history").unwrap(),
        [
            "-json",
            "-attributes",
            &attributes,
            "-limit",
            "2",
            "-constraint",
            &constraint([job_id(20), job_id(99)]),
        ]
    );
    assert!(
        stand_ins.accounts().is_empty(),
        "queries run as the manager"
    );
    let by_job: BTreeMap<JobId, &Phase> = observations
        .iter()
        .map(|o| (o.job.unwrap(), &o.phase))
        .collect();
    assert_eq!(
        by_job.len(),
        3,
        "only the jobs asked about, the unknown one left out"
    );
    assert!(matches!(by_job[&job_id(11)], Phase::Pending { .. }));
    assert_eq!(*by_job[&job_id(12)], Phase::Running);
    assert_eq!(*by_job[&job_id(20)], Phase::Exited { code: 0 });
}

#[test]
fn cancel_and_halt_run_condor_rm_and_condor_hold_as_the_account() {
    let stand_ins = StandIns::new();
    let target = Htcondor::new(stand_ins.config());
    block_on(target.cancel(&tracked(12, Some("4712.0")))).unwrap();
    assert_eq!(stand_ins.args("condor_rm").unwrap(), ["4712.0"]);
    block_on(target.cancel(&tracked(13, None))).unwrap();
    assert_eq!(
        stand_ins.args("condor_rm").unwrap(),
        ["-constraint", &constraint([job_id(13)])],
        "a job whose id was never stored is found by OngridJobId"
    );
    block_on(target.cancel(&tracked(14, Some("9999.0")))).unwrap();
    block_on(target.halt(&tracked(12, Some("4712.0")))).unwrap();
    assert_eq!(
        stand_ins.args("condor_hold").unwrap(),
        ["-reason", HALT_HOLD_REASON, "4712.0"]
    );
    assert_eq!(stand_ins.accounts(), ["alice"; 4]);
}

#[test]
fn logs_read_the_jobs_output_file_from_an_offset() {
    let stand_ins = StandIns::new();
    let target = Htcondor::new(stand_ins.config());
    let job = tracked(40, Some("4740.0"));
    let none = block_on(target.logs(&job, 0, 100)).unwrap();
    assert_eq!((none.data.len(), none.size), (0, 0), "no output yet");
    let dir = target.job_dir(job.job);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("job.out"), "hello\nworld\n").unwrap();
    let rest = block_on(target.logs(&job, 6, 100)).unwrap();
    assert_eq!((rest.data.as_slice(), rest.size), (&b"world\n"[..], 12));
    let capped = block_on(target.logs(&job, 0, 3)).unwrap();
    assert_eq!(capped.data, b"hel");
    assert!(Path::new(&dir).join("job.out").exists());
}

// ---------------------------------------------------------------------------------------------
// The mirroring loop over stand-ins whose queue the test sets.

/// `condor_*` stand-ins whose `condor_q` prints the ads the test wrote to `queue.json`:
/// `condor_submit` answers `4801.0`, `4802.0`, ... (its stdin kept as `condor_submit.<n>.stdin`),
/// `condor_rm` and `condor_hold` append their arguments to `calls.log`.
struct Schedd {
    dir: tempfile::TempDir,
}

impl Schedd {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let scripts = [
            (
                "condor_submit",
                format!(
                    "n=$(cat {d}/submits 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {d}/submits\n\
                     cat > {d}/condor_submit.$n.stdin\nprintf '480%s.0 - 480%s.0\\n' $n $n\n"
                ),
            ),
            ("condor_q", format!("cat {d}/queue.json 2>/dev/null; true\n")),
            ("condor_history", "true\n".to_owned()),
            (
                "condor_rm",
                format!("echo \"condor_rm $*\" >> {d}/calls.log\necho 'All jobs matching the given job IDs have been marked for removal.'\n"),
            ),
            (
                "condor_hold",
                format!("echo \"condor_hold $*\" >> {d}/calls.log\necho 'Job held'\n"),
            ),
            ("runas", "shift\nexec \"$@\"\n".to_owned()),
        ];
        for (name, body) in scripts {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for sub in ["out", "logs"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn config(&self) -> HtcondorConfig {
        HtcondorConfig {
            condor_submit: self.path("condor_submit"),
            condor_q: self.path("condor_q"),
            condor_history: self.path("condor_history"),
            condor_rm: self.path("condor_rm"),
            condor_hold: self.path("condor_hold"),
            image_dir: PathBuf::from("/srv/ongrid/images"),
            output_dir: self.path("out"),
            request_disk: MemorySize::parse("20G").unwrap(),
            run_as: RunAs(vec![
                self.path("runas").display().to_string(),
                "{account}".into(),
            ]),
            extra_lines: Vec::new(),
        }
    }

    /// What `condor_q` prints from now on: one ad per `(engine id, ongrid job, JobStatus,
    /// more attributes)`.
    fn queue(&self, ads: &[(&str, JobId, i64, Value)]) {
        let ads: Vec<Value> = ads
            .iter()
            .map(|(engine_id, job, status, more)| {
                let (cluster, proc) = engine_id.split_once('.').unwrap();
                let mut ad = serde_json::json!({
                    "ClusterId": cluster.parse::<i64>().unwrap(),
                    "ProcId": proc.parse::<i64>().unwrap(),
                    "JobStatus": status,
                    "OngridJobId": job.to_string(),
                    "JobBatchName": format!("ongrid-{job}"),
                });
                for (k, v) in more.as_object().unwrap() {
                    ad[k] = v.clone();
                }
                ad
            })
            .collect();
        std::fs::write(self.path("queue.json"), Value::Array(ads).to_string()).unwrap();
    }

    /// The `condor_rm` and `condor_hold` calls so far.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn submitted(&self, n: u32) -> String {
        std::fs::read_to_string(self.path(&format!("condor_submit.{n}.stdin"))).unwrap()
    }
}

/// Through the manager's mirroring loop, one round at a time: a halted job, held by HTCondor
/// after `condor_hold`, is HALTED in ongrid and then removed with `condor_rm` (it would
/// otherwise stay Held in the schedd); a `--restartable` one continues its chain as a new job
/// that `condor_submit` gets with its own `ONGRID_JOB_ID`; and that job, idle in HTCondor,
/// says why in HTCondor's words instead of this site's queue.
#[test]
fn the_loop_removes_halted_jobs_from_the_schedd_and_resubmits_restartable_ones() {
    use std::sync::Arc;

    use ongrid_core::job::{JobImage, JobState, JobTarget};
    use ongrid_core::Dn;
    use ongrid_manager::clock::SystemClock;
    use ongrid_manager::domain::grid_jobs::GridJob;
    use ongrid_manager::domain::jobs::{self, JobLimits, JobRecord, Submitter};
    use ongrid_manager::grid_mirror::GridMirror;
    use ongrid_manager::job_logs::JobLogs;
    use ongrid_manager::store::{SqliteStore, Store};
    use ongrid_manager::targets::{Targets, TargetsConfig};
    use serde_json::json;

    let schedd = Schedd::new();
    block_on(async {
        let store: Arc<dyn Store> =
            Arc::new(SqliteStore::open(&schedd.path("manager.db")).await.unwrap());
        let alice = Dn::parse("/DC=org/CN=Alice Smith").unwrap();
        let user = store.user(&alice, 2000).await.unwrap();
        let targets = Targets::from_config(&TargetsConfig {
            htcondor: Some(schedd.config()),
            ..TargetsConfig::default()
        });
        let mirror = GridMirror::new(
            store.clone(),
            Arc::new(SystemClock),
            Arc::new(targets),
            JobLimits::default(),
            JobLogs::new(schedd.path("logs")),
        );
        let submit = |restartable: bool| {
            let spec = JobSpecFile {
                image: Some("mymodel:v1".into()),
                command: vec!["python".into(), "train.py".into()],
                restartable,
                ..JobSpecFile::default()
            }
            .validate(Utc::now())
            .unwrap();
            let new = jobs::submit(
                JobId::new_random(),
                Submitter {
                    owner: alice.clone(),
                    user_name: user.user_name.clone(),
                    uid: user.uid,
                },
                spec,
                JobImage {
                    digest: format!("sha256:{}", "9f".repeat(32)),
                    docker_image: "ongrid/alice-smith/mymodel:v1".into(),
                },
                &JobLimits::default(),
                Some(GridJob::submitting(
                    JobTarget::Htcondor,
                    LocalAccount::parse("alice").unwrap(),
                    Utc::now(),
                )),
                Utc::now(),
            )
            .unwrap();
            let store = store.clone();
            let mirror = &mirror;
            async move {
                let job = store.create_job(new).await.unwrap();
                mirror.hand_over(job).await.unwrap()
            }
        };
        let job = |id: JobId| {
            let store = store.clone();
            async move { store.job(id).await.unwrap().unwrap() }
        };
        let engine_id = |job: &JobRecord| job.grid.as_ref().unwrap().engine_id.clone().unwrap();

        let restartable = submit(true).await;
        let plain = submit(false).await;
        assert_eq!(engine_id(&restartable).as_str(), "4801.0");
        assert_eq!(engine_id(&plain).as_str(), "4802.0");
        let running = json!({"RemoteHost": "slot1_1@gpu-01", "NumJobStarts": 1});
        schedd.queue(&[
            ("4801.0", restartable.id, 2, running.clone()),
            ("4802.0", plain.id, 2, running),
        ]);
        mirror.round().await.unwrap();
        for id in [restartable.id, plain.id] {
            let running = job(id).await;
            assert_eq!(running.state(), JobState::Running);
            let change = jobs::halt_by_owner(&running, Utc::now()).unwrap();
            store.job_transition(id, change, None).await.unwrap();
        }

        // The halt: condor_hold, HALTING.
        mirror.round().await.unwrap();
        assert_eq!(
            schedd.calls(),
            [
                format!("condor_hold -reason {HALT_HOLD_REASON} 4801.0"),
                format!("condor_hold -reason {HALT_HOLD_REASON} 4802.0"),
            ]
        );
        // HTCondor sent SIGUSR1 and holds both.
        let held = json!({
            "LastRemoteHost": "slot1_1@gpu-01",
            "NumJobStarts": 1,
            "HoldReasonCode": 1,
            "HoldReasonSubCode": 0,
            "HoldReason": HALT_HOLD_REASON,
        });
        schedd.queue(&[
            ("4801.0", restartable.id, 5, held.clone()),
            ("4802.0", plain.id, 5, held),
        ]);
        mirror.round().await.unwrap();
        let halted = job(restartable.id).await;
        assert_eq!(halted.state(), JobState::Halted);
        let next_id = halted
            .next_job
            .expect("a halted restartable job continues its chain");
        assert_eq!(job(plain.id).await.state(), JobState::Halted);
        assert_eq!(job(plain.id).await.next_job, None, "not restartable");
        let next = job(next_id).await;
        assert_eq!(next.state(), JobState::Queued);
        assert_eq!(next.chain.restart_count, 1);

        // The next round removes both held jobs and hands the next job to HTCondor anew (as
        // 4803.0, which condor_q lists from then on).
        let held_still = std::fs::read_to_string(schedd.path("queue.json")).unwrap();
        let mut ads: Vec<Value> = serde_json::from_str(&held_still).unwrap();
        ads.push(json!({
            "ClusterId": 4803, "ProcId": 0, "JobStatus": 1,
            "OngridJobId": next_id.to_string(), "JobBatchName": format!("ongrid-{next_id}"),
        }));
        std::fs::write(schedd.path("queue.json"), Value::Array(ads).to_string()).unwrap();
        mirror.round().await.unwrap();
        assert_eq!(
            schedd.calls()[2..],
            ["condor_rm 4801.0".to_owned(), "condor_rm 4802.0".to_owned()]
        );
        let next = job(next_id).await;
        assert_eq!(engine_id(&next).as_str(), "4803.0");
        let description = schedd.submitted(3);
        assert!(
            description.contains(&format!(
                "ONGRID_JOB_ID={next_id} ONGRID_RESTART_COUNT=1 ONGRID_RESTART_INITIAL_JOB_ID={}",
                restartable.id
            )),
            "{description}"
        );
        assert!(description.contains(&format!("+OngridJobId = \"{next_id}\"")));

        // Removed, the old jobs are done; the new one waits for a machine, in HTCondor's words.
        let removed = json!({"RemoveReason": "via condor_rm (by user alice)", "NumJobStarts": 1});
        schedd.queue(&[
            ("4801.0", restartable.id, 3, removed.clone()),
            ("4802.0", plain.id, 3, removed),
            (
                "4803.0",
                next_id,
                1,
                json!({"LastRejMatchReason": "no match found"}),
            ),
        ]);
        mirror.round().await.unwrap();
        // Once HTCondor says they are removed, they are left alone.
        let calls = schedd.calls().len();
        mirror.round().await.unwrap();
        assert_eq!(schedd.calls().len(), calls, "{:?}", schedd.calls());
        for id in [restartable.id, plain.id] {
            let done = job(id).await;
            assert!(done.grid.as_ref().unwrap().engine_final);
            assert_eq!(done.state(), JobState::Halted);
        }
        let next = job(next_id).await;
        let waiting = jobs::waiting_reason(&next, &[], Utc::now()).unwrap();
        assert!(
            waiting.starts_with("no HTCondor machine offers what it asks"),
            "{waiting}"
        );
    });
}
