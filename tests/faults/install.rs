//! Faults in `install` and `uninstall`: the conf dir is left whole, either way.

use super::*;

/// The files of a directory (dot files aside), parsed.
fn conf_files(dir: &Path) -> BTreeMap<String, Value> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|error| panic!("read {}: {error}", dir.display()))
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with('.'))
        .map(|name| {
            let text = std::fs::read_to_string(dir.join(&name))
                .unwrap_or_else(|error| panic!("read {name}: {error}"));
            let value = serde_json::from_str(&text)
                .unwrap_or_else(|error| panic!("{name} is not whole JSON ({error}): {text}"));
            (name, value)
        })
        .collect()
}

/// `install` and `uninstall` with faults: each answers with success or one error; the conf
/// dir holds, file by file, what it held before or after (never a torn file), and the bin dir
/// no binary or the whole one.
#[test]
fn faults_in_install_and_uninstall() {
    let work = std::env::temp_dir().join("cnibpf-test-faults-install");
    let _ = std::fs::remove_dir_all(&work);
    let (conf, bin) = (work.join("net.d"), work.join("bin"));
    std::fs::create_dir_all(&conf).expect("conf dir");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let original = json!({ "cniVersion": "1.0.0", "name": "k8s", "plugins": [
        { "type": "bridge", "bridge": "cni0", "ipam": { "type": "host-local", "subnet": "10.88.0.0/16" } },
        { "type": "portmap", "capabilities": { "portMappings": true } },
    ]});
    let write_original = || {
        std::fs::write(conf.join("10-k8s.conflist"), original.to_string()).expect("write");
        let _ = std::fs::remove_file(conf.join("10-k8s.cnibpf.conflist"));
        let _ = std::fs::remove_file(bin.join("cnibpf"));
    };
    let binary = cnibpf_binary();
    let binary_len = std::fs::metadata(&binary).expect("binary").len();
    let run = |prefix: Option<&[String]>, args: &[&str]| {
        let mut command = match prefix {
            Some(prefix) => wrapped(prefix, &binary),
            None => std::process::Command::new(&binary),
        };
        command
            .args(args)
            .arg("--conf-dir")
            .arg(&conf)
            .arg("--bin-dir")
            .arg(&bin)
            .env_remove("CNI_COMMAND")
            .output()
            .expect("run cnibpf")
    };
    // A pinPath of the test's own: uninstall removes the datapath of the instance it names.
    let entry = work.join("entry.json");
    std::fs::write(
        &entry,
        json!({ "pinPath": "/sys/fs/bpf/cnibpf-test-faults-install" }).to_string(),
    )
    .expect("write the entry");
    let entry = entry.display().to_string();
    let install: &[&str] = &["install", "--replace-portmap", "--entry", &entry];
    let uninstall: &[&str] = &["uninstall"];
    write_original();
    let before = conf_files(&conf);
    assert!(run(None, install).status.success());
    let after = conf_files(&conf);
    assert_ne!(before, after, "install writes cnibpf's conflist");
    let assert_whole = |context: &str| {
        let files = conf_files(&conf);
        for (name, value) in &files {
            assert!(
                before.get(name) == Some(value) || after.get(name) == Some(value),
                "{context}: {name} is neither what it was nor what install makes: {value}"
            );
        }
        let installed = bin.join("cnibpf");
        if let Ok(metadata) = std::fs::metadata(&installed) {
            assert_eq!(metadata.len(), binary_len, "{context}: a torn binary");
        }
    };
    let mut tally = Tally::default();
    for (verb, args, start, end) in [
        ("install", install, &before, &after),
        ("uninstall", uninstall, &after, &before),
    ] {
        let reset = |state: &BTreeMap<String, Value>| {
            write_original();
            if state == &after {
                assert!(run(None, install).status.success());
            }
        };
        reset(start);
        let counter = CallCounter::new();
        assert!(run(Some(&counter.prefix()), args).status.success());
        assert_eq!(&conf_files(&conf), end, "a clean {verb}");
        let counts = counter.counts();
        for fault in plan(&counts, SAMPLE) {
            reset(start);
            let context = format!("{verb} with {fault}");
            let output = run(Some(&fault.prefix()), args);
            let succeeded = assert_admin_answer(&output, verb, &context);
            assert_whole(&context);
            if succeeded {
                assert_eq!(&conf_files(&conf), end, "{context}: succeeded");
            }
            assert!(
                run(None, args).status.success(),
                "{context}: {verb} without the fault"
            );
            assert_eq!(&conf_files(&conf), end, "{context}: then without the fault");
            tally.count(verb, succeeded);
        }
    }
    tally.print("install");
    let _ = std::fs::remove_dir_all(&work);
}
