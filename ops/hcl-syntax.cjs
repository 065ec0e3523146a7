// HCL syntax of each file named on the command line, read by Terraform's own parser
// (hashicorp/hcl compiled to WebAssembly in @cdktf/hcl2json). Exit 1 on the first bad file set.
const fs = require("fs");
const { parse } = require("@cdktf/hcl2json");

(async () => {
  let bad = 0;
  for (const file of process.argv.slice(2)) {
    try {
      await parse(file, fs.readFileSync(file, "utf8"));
    } catch (e) {
      bad += 1;
      console.log(String(e.message || e).replace(/^parse config: /, ""));
    }
  }
  console.log(`hcl-syntax: ${process.argv.length - 2} file(s), ${bad} with errors`);
  process.exit(bad ? 1 : 0);
})();
