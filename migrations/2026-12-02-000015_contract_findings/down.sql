DROP TABLE contract_findings;
