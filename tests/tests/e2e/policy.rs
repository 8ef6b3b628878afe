//! Site policy with the real binaries: a site that admits one VO refuses a certificate outside
//! it with the fix (`devctl whoami`), admits its admins in group `admins`, and `devctl share`
//! shows the GPU-hours a running session charges to its group; under length classes long work
//! waits at its cap naming it while short work runs.

use std::time::Duration;

use ongrid_e2e::{SimGpu, Site};
use serde_json::Value;

const POLICY: &str = "[policy]\ncontact = \"gpu-support@example.org\"\n\
                      admit = [{ vo = \"atlas\" }]\n\n\
                      [fairshare]\nhalf_life = \"1 day\"\nshares = { atlas = 3, admins = 1 }\n\
                      cost = { A100 = 2.0 }\n";

#[test]
fn a_site_that_admits_one_vo_refuses_others_and_share_shows_each_groups_usage() {
    let mut site = Site::start_configured(&[SimGpu::a100(1)], POLICY, "");
    let alice = site.user("Alice");
    let out = site.devctl(&alice, &["whoami"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("this site does not admit /DC=org/O=ongrid-test/CN=Alice")
            && stderr.contains("it needs membership of VO atlas")
            && stderr.contains("voms-proxy-init --voms atlas")
            && stderr.contains("ask gpu-support@example.org"),
        "{stderr}"
    );
    println!("$ devctl whoami   # Alice, no VOMS attributes\n{stderr}");

    let admin = site.admin.clone();
    let who = site.devctl_ok(&admin, &["whoami"]);
    assert!(
        who.contains("admitted (admin)") && who.contains("admins"),
        "{who}"
    );
    println!("$ devctl whoami   # the admin\n{who}");

    site.devctl_ok(&admin, &["session", "new", "--name", "train1", "--wait"]);
    let share: Value = site.wait_until(
        "the admin's session to be charged to group admins",
        Duration::from_secs(60),
        || {
            let share: Value = site.devctl_json(&admin, &["share"]).ok()?;
            let charged = share["groups"]
                .as_array()?
                .iter()
                .any(|g| g["group"] == "admins" && g["usage"].as_f64().unwrap_or(0.0) > 0.0);
            charged.then_some(share)
        },
    );
    assert_eq!(share["enabled"], true);
    let text = site.devctl_ok(&admin, &["share"]);
    assert!(text.starts_with("GROUP"), "{text}");
    assert!(text.contains("atlas") && text.contains("admins"), "{text}");
    println!("$ devctl share\n{text}");
}

/// CHTC's length classes with one long GPU per user: a session living the site's 7 days is long
/// work, so a second such session waits naming the cap; a session asking for 8 hours is short
/// work and runs; a job longer than the longest class is refused naming it.
#[test]
fn long_work_waits_at_its_length_class_cap_and_short_work_runs() {
    let mut site = Site::start_configured(
        &[SimGpu::a100(1), SimGpu::a100(2)],
        "[limits.length_classes]\nlong_max_gpus = 1\n",
        "",
    );
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "week", "--wait"]);
    site.devctl_ok(&alice, &["session", "new", "--name", "second"]);
    let second = site.devctl_ok(&alice, &["session", "show", "second"]);
    assert!(
        second.contains(
            "waits for a limit: you hold 1 of at most 1 GPUs in work longer than 1 day \
             (limits.length_classes long_max_gpus)"
        ),
        "{second}"
    );
    println!("$ devctl session show second\n{second}");
    let short = site.devctl_ok(
        &alice,
        &[
            "session",
            "new",
            "--name",
            "short",
            "--max-duration",
            "8h",
            "--wait",
        ],
    );
    println!("$ devctl session new --name short --max-duration 8h --wait\n{short}");
    let args = [
        "job",
        "submit",
        "--image",
        "mymodel:v1",
        "--max-duration",
        "8d",
        "--",
        "python",
        "train.py",
    ];
    let out = site.devctl(&alice, &args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "a job of up to 1 week 1 day can never run here: the longest work the site takes is \
             1 week (limits.length_classes long)"
        ),
        "{stderr}"
    );
    println!("$ devctl {}\n{stderr}", args.join(" "));
}
